"""The fast tier's fixtures: fake shard files (GGUF headers, no weights) and daemons on fake workers, run in
this process (tests/support/fake_daemon.py). Every daemon a test starts is stopped after it, its books
checked first."""

from __future__ import annotations

import pathlib

import pytest

from tests.support.fake_daemon import TOTAL_LAYERS, FakeDaemon, fake_shard_file
from tests.support.pipes import pipe_pair


@pytest.fixture(autouse=True)
def _tracker(resource_tracker_running):
    """Fake workers' segments are created in this process: multiprocessing's resource tracker starts once."""


@pytest.fixture(scope="session")
def fake_files(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("fake-shards")


@pytest.fixture(scope="session")
def fake_model(fake_files) -> pathlib.Path:
    """A whole fake model: takes token ids, returns logits (a one-daemon route)."""
    return fake_shard_file(fake_files)


@pytest.fixture(scope="session")
def fake_shards(fake_files) -> list[pathlib.Path]:
    """A fake model cut in three: tokens -> hidden -> hidden -> logits."""
    cuts = (0, 2, 4, TOTAL_LAYERS)
    return [fake_shard_file(fake_files, start, stop) for start, stop in zip(cuts, cuts[1:])]


@pytest.fixture
def sockets(tmp_path) -> pathlib.Path:
    """A short directory for sockets (a Unix socket path holds at most 107 bytes)."""
    directory = pathlib.Path("/tmp") / f"kvpool-unit-{abs(hash(tmp_path)) % 10**10}"
    directory.mkdir(mode=0o700, exist_ok=True)
    yield directory
    for path in directory.iterdir():
        path.unlink(missing_ok=True)
    directory.rmdir()


@pytest.fixture
def serve(sockets):
    """serve(model, *flags, name=..., kinds=...): a FakeDaemon, stopped after the test with its books checked."""
    started: list[FakeDaemon] = []

    def start(model: pathlib.Path, *options: str, name: str = "d", kinds=None) -> FakeDaemon:
        daemon = FakeDaemon(model, sockets / f"{name}.sock", *options, kinds=kinds)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.running:
            with daemon.client() as client:
                assert client.stats().integrity == "ok"
            daemon.stop()


@pytest.fixture
def pipe():
    """(supervisor end, worker end) of a worker pipe, closed after the test."""
    supervisor, worker = pipe_pair()
    yield supervisor, worker
    supervisor.close()
    worker.close()

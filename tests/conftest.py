"""Shared fixtures: the real bundled model, its shards (cut once per test session), leftover-process cleanup."""

from __future__ import annotations

import os
import pathlib
from multiprocessing import resource_tracker

import psutil
import pytest

from kvpool.host import CACHE_HOME_ENV
from kvpool.local.chain import LocalChain
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import cached_shards
from kvpool.shard.header import ShardInfo
from kvpool.shard.ranges import parse_splits
from tests.support.daemons import private_socket_dir
from workers.runtime.model import ShardModel

EVEN_SPLIT = "0:10,10:20,20:30"
UNEVEN_SPLIT = "0:7,7:22,22:30"
TOTAL_LAYERS = 30
# Largest |logit difference| against process mode (one ShardContext per session, same appends), measured
# on an Intel Xeon (AVX-512) with llama-cpp-python 0.3.36 built here: 0.0 for prefills, one-row decodes
# of four sessions in one llama_decode, and a prefill chunk beside decoding sessions. What differs
# between the two is the row count of the weight matmuls; a CPU whose kernels depend on it fails this
# test with the difference it measured.
PROCESS_MODE_TOLERANCE = 0.0

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea, the wind and a lighthouse keeper who counts the waves at night.",
)


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory: pytest.TempPathFactory):
    """The suite's own user cache directory ($XDG_CACHE_HOME, inherited by every daemon it starts): the start-up
    probe's readings (`kvpool serve --calibration-cache user`, the default) are kept there for the suite's later
    starts of the same shard, and nothing the suite measures lands in, or is read from, the user's ~/.cache."""
    before = os.environ.get(CACHE_HOME_ENV)
    os.environ[CACHE_HOME_ENV] = str(tmp_path_factory.mktemp("user-cache"))
    yield pathlib.Path(os.environ[CACHE_HOME_ENV])
    if before is None:
        os.environ.pop(CACHE_HOME_ENV, None)
    else:
        os.environ[CACHE_HOME_ENV] = before


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def shard_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("shards")


@pytest.fixture(scope="session")
def shard_sets(model_path: pathlib.Path, shard_root: pathlib.Path) -> dict[str, list[ShardInfo]]:
    return {
        split: cached_shards(model_path, parse_splits(split, TOTAL_LAYERS), root=shard_root / split.replace(",", "_"))
        for split in (EVEN_SPLIT, UNEVEN_SPLIT)
    }


@pytest.fixture(scope="session")
def tokenizer(model_path: pathlib.Path):
    with Tokenizer(model_path) as tokenizer:
        yield tokenizer


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.chat_prompt(prompt)) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def shards(shard_sets: dict[str, list[ShardInfo]]) -> list[ShardInfo]:
    """The even split in 3 shards (the chain most daemon tests run)."""
    return shard_sets[EVEN_SPLIT]


@pytest.fixture(scope="module")
def local_chain(shards: list[ShardInfo]):
    """The even split's shards in process, one compute thread each: the reference a chain of daemons is
    compared with (kvpool.local.chain.LocalChain, the same partition of appends gives the same bits)."""
    with LocalChain([shard.path for shard in shards]) as chain:
        yield chain


@pytest.fixture(scope="module")
def whole_model(model_path: pathlib.Path):
    """The unsharded bundled model in process (workers.runtime.model.ShardModel, its defaults: one thread,
    flash attention off), whose contexts the shards and daemons are compared with."""
    with ShardModel(model_path) as model:
        yield model


@pytest.fixture(scope="module")
def socket_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A short private directory for one test module's daemon sockets."""
    return private_socket_dir(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]))


@pytest.fixture(scope="session")
def resource_tracker_running():
    """An in-process worker creates shared memory, which starts multiprocessing's resource tracker, a helper
    process that lives as long as this one: start it before the leftover-process check looks."""
    resource_tracker.ensure_running()


@pytest.fixture(autouse=True)
def no_leftover_children():
    """Kill any child process a test left behind, and fail the test that left it.

    Direct children only: a daemon's workers are the daemon's to manage (DaemonProcess.stop checks them).
    """
    before = {child.pid for child in psutil.Process().children()}
    yield
    leftovers = [child for child in psutil.Process().children() if child.pid not in before]
    for child in leftovers:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)
    alive = [child.pid for child in leftovers if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, f"test left child processes behind: {[c.pid for c in leftovers]} (still alive: {alive})"


TIERS = {  # folder -> markers: `pytest -m unit`, `-m "not slow"`; scripts/test.sh --fast runs tests/unit
    "unit": ("unit",), "runtime": ("runtime",), "daemon": ("daemon",), "drills": ("drills", "slow"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its tier, the folder it lives in."""
    for item in items:
        for marker in TIERS.get(item.path.parent.name, ()):
            item.add_marker(marker)

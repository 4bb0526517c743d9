"""A kvpool daemon in the test's own process, on fake workers (tests/support/fake_worker.py): the real
Supervisor (socket, books, admission, parking, housekeeping, transfers, drain) on its own event loop in a
thread, serving a real Unix socket that kvpool.Client talks to. Nothing loads a model: the shard files are
GGUF headers written here (`fake_shard_file`), read by the daemon as a real shard's.

`FakeDaemon(...)` starts it and waits until the socket answers (a hang guard, never a verdict on speed);
`stop()` shuts it down as `kvpool status --shutdown` would; `drain()` as SIGTERM would. `request_stop()` and
`request_drain()` are the same without waiting (what SIGINT and SIGTERM call in a `kvpool serve` process),
`joined()` the wait. `stopped(session_id, ...)` stops the workers serving those sessions for a block, as
tests.support.daemons.stopped(pid) SIGSTOPs one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import pathlib
import threading
import time

import gguf

from kvpool.cli import serve
from kvpool.client.client import Client
from kvpool.daemon.notify import Notifier
from kvpool.daemon.supervisor import Supervisor
from kvpool.shard import header
from tests.support.fake_worker import FakeServer, fake_kinds

START_HANG_GUARD_S = 120.0  # in-process, no model: a start takes well under a second
STOP_HANG_GUARD_S = 120.0
N_EMBD = 64
N_VOCAB = 256
TOTAL_LAYERS = 6


def fake_shard_file(directory: pathlib.Path, layer_start: int = 0, layer_stop: int = TOTAL_LAYERS, *, total_layers: int = TOTAL_LAYERS,
                    n_embd: int = N_EMBD, n_vocab: int = N_VOCAB) -> pathlib.Path:
    """A GGUF file with a llama header and no tensors: what the daemon reads of a shard (its shape and where
    it came from), for fake workers only (llama.cpp could not load it)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"fake-{layer_start}-{layer_stop}-of-{total_layers}-{n_embd}x{n_vocab}.gguf"
    if path.exists():
        return path
    whole = (layer_start, layer_stop) == (0, total_layers)
    middle = layer_start > 0 and layer_stop < total_layers
    writer = gguf.GGUFWriter(path.with_suffix(".partial"), "llama")
    writer.add_uint32("llama.block_count", layer_stop - layer_start)
    writer.add_uint32("llama.embedding_length", n_embd)
    if middle:
        writer.add_string("tokenizer.ggml.model", "none")
        writer.add_uint32("llama.vocab_size", 32)
    else:
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_array("tokenizer.ggml.tokens", [f"t{index}" for index in range(n_vocab)])
    if not whole:
        writer.add_uint32(header.KEY_FORMAT, header.SHARD_FORMAT)
        writer.add_uint32(header.KEY_LAYER_START, layer_start)
        writer.add_uint32(header.KEY_LAYER_STOP, layer_stop)
        writer.add_uint32(header.KEY_TOTAL_LAYERS, total_layers)
        writer.add_string(header.KEY_SOURCE_SHA256, "f" * 64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".partial").rename(path)
    return path


class FakeDaemon:
    """The real Supervisor on fake workers, in a thread of this process, configured by `kvpool serve` flags
    (`options`, as tests.support.daemons.DaemonProcess takes them); `kinds`: fake_kinds(...) with behaviour knobs;
    `notifier`: the service manager's side channel (a `kvpool serve` process takes it from NOTIFY_SOCKET)."""

    def __init__(self, model: pathlib.Path, socket_path: pathlib.Path, *options: str, kinds: tuple[type, type] | None = None,
                 notifier: Notifier | None = None) -> None:
        parser = argparse.ArgumentParser()
        serve.define_options(parser)
        defaults = ["--threads", "1", "--n-ctx", "64", "--max-sessions", "2", "--housekeeping-interval", "0.05"]
        args = parser.parse_args(["--model", str(model), "--socket", str(socket_path), *defaults, *options])
        self.config = serve.config_from_args(args)
        self.socket = socket_path
        self.lines: list[str] = []
        self.supervisor = Supervisor(self.config, announce=self.lines.append, notifier=notifier, worker_kinds=kinds or fake_kinds())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"fake-daemon-{socket_path.name}", daemon=True)
        self._thread.start()
        self._wait_serving()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self.supervisor.run())
        except BaseException as error:  # noqa: BLE001 - reported by _wait_serving and stop
            self._error = error
        finally:
            loop.close()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_HANG_GUARD_S
        while not any(line.startswith("ready on") for line in self.lines):
            if not self._thread.is_alive():
                raise RuntimeError(f"the fake daemon did not start: {self._error!r}; log: {self.lines}")
            if time.monotonic() > deadline:
                raise AssertionError(f"hang guard: the fake daemon was not ready after {START_HANG_GUARD_S:.0f} s; log: {self.lines}")
            time.sleep(0.005)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def client(self, **options) -> Client:
        options.setdefault("direct", False)  # a fake worker serves no direct channel
        return Client(self.socket, **options)

    def log(self) -> str:
        return "\n".join(self.lines)

    def _call_soon(self, method) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(method)

    def fake_server_of(self, session_id: str) -> FakeServer:
        """The fake worker (one process's, in batched mode) that holds `session_id`'s context."""
        service = self.supervisor.service
        worker = service.pool.get(service.books.table.get(session_id).worker_name)
        return getattr(worker, "fake_server", None) or worker.process.fake_server

    @contextlib.contextmanager
    def stopped(self, *session_ids: str):
        """The workers serving `session_ids` (none named: every worker) are stopped inside the block: a
        command sent to one stays in flight for as long as the test wants, and completes once the block ends."""
        pool = self.supervisor.service.pool
        servers = [self.fake_server_of(session) for session in session_ids] if session_ids else [worker.fake_server for worker in pool.processes()]
        with contextlib.ExitStack() as stack:
            for server in {id(server): server for server in servers}.values():
                stack.enter_context(server.stopped())
            yield

    def request_stop(self) -> None:
        """Ask for a stop at once (what SIGINT and Shutdown{} call), without waiting for it."""
        self._call_soon(self.supervisor.request_stop)

    def request_drain(self) -> None:
        """Ask for a drain (what SIGTERM and Shutdown{drain: true} call), without waiting for it."""
        self._call_soon(self.supervisor.request_drain)

    def stop(self) -> int:
        """Stop at once (Shutdown{}); returns the supervisor's exit code."""
        self.request_stop()
        return self.joined()

    def drain(self) -> int:
        """Drain, then stop (SIGTERM); returns the supervisor's exit code."""
        self.request_drain()
        return self.joined()

    def joined(self) -> int:
        """Wait (a hang guard) until the daemon has stopped; its exit code."""
        return self._joined()

    def _joined(self) -> int:
        self._thread.join(STOP_HANG_GUARD_S)
        assert not self._thread.is_alive(), f"hang guard: the fake daemon did not stop within {STOP_HANG_GUARD_S:.0f} s"
        if self._error is not None:
            raise self._error
        return self.supervisor.exit_code

    def __enter__(self) -> FakeDaemon:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._thread.is_alive():
            self.stop()


def started(serve, model, *flags: str):
    """A fake daemon started (the `serve` fixture) with `flags` and stopped at once: its stats and its log."""
    daemon = serve(model, *flags)
    with daemon.client() as client:
        stats = client.stats()
    daemon.stop()
    return stats, daemon.log()


logging.getLogger("kvpool.serve").setLevel(logging.WARNING)

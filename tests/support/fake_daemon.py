"""A kvpool daemon in the test's own process, on fake workers (tests/support/fake_worker.py): the real
Supervisor (socket, books, admission, parking, housekeeping, transfers, drain) on its own event loop in a
thread, serving a real Unix socket that kvpool.Client talks to. Nothing loads a model: the shard files are
GGUF headers written here (`fake_shard_file`), read by the daemon as a real shard's.

`FakeDaemon(...)` starts it and waits until the socket answers (a hang guard, never a verdict on speed);
`stop()` shuts it down as `kvpool status --shutdown` would; `drain()` as SIGTERM would.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import threading
import time

import gguf

from kvpool.client.client import Client
from kvpool.cli import serve
from kvpool.daemon.supervisor import Supervisor
from kvpool.shard import header
from tests.support.fake_worker import fake_kinds

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
    (`options`, as tests.support.daemons.DaemonProcess takes them); `kinds`: fake_kinds(...) with behaviour knobs."""

    def __init__(self, model: pathlib.Path, socket_path: pathlib.Path, *options: str, kinds: tuple[type, type] | None = None) -> None:
        parser = argparse.ArgumentParser()
        serve.define_options(parser)
        defaults = ["--threads", "1", "--n-ctx", "64", "--max-sessions", "2", "--housekeeping-interval", "0.05"]
        args = parser.parse_args(["--model", str(model), "--socket", str(socket_path), *defaults, *options])
        self.config = serve.config_from_args(args)
        self.socket = socket_path
        self.lines: list[str] = []
        self.supervisor = Supervisor(self.config, announce=self.lines.append, worker_kinds=kinds or fake_kinds())
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

    def stop(self) -> int:
        """Stop at once (Shutdown{}); returns the supervisor's exit code."""
        self._call_soon(self.supervisor.request_stop)
        return self._joined()

    def drain(self) -> int:
        """Drain, then stop (SIGTERM); returns the supervisor's exit code."""
        self._call_soon(self.supervisor.request_drain)
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


logging.getLogger("kvpool.serve").setLevel(logging.WARNING)

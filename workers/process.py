"""The worker process: loads one shard once, holds at most one live context, obeys the supervisor's pipe.

Started with the `spawn` method by kvpool.pool; knows nothing of budgets, sessions or other workers.
A worker never outlives its supervisor: it exits when the pipe reaches EOF (while idle) and, from a
watchdog thread, as soon as its parent process changes (the supervisor died, even mid-decode).
"""

from __future__ import annotations

import ctypes
import contextlib
import ctypes.util
import os
import selectors
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import msgspec
import numpy as np

from workers.commands import (
    ABORT_FLAG_OFFSET,
    CONTROL_BYTES,
    AnyCommand,
    Appended,
    BindChannel,
    ChannelState,
    CloseContext,
    Closed,
    Exit,
    Failed,
    Opened,
    OpenContext,
    Ready,
    Restored,
    RestoreState,
    RevokeChannel,
    RunAppend,
    Saved,
    SaveState,
    Truncated,
    TruncateContext,
)
from workers.batched_server import BatchedWorkerServer
from workers.compute_locks import ComputeLocks
from workers.direct import FRAME_DEADLINE_S, DirectChannel
from workers.errors import ShardRuntimeError
from workers.context import ShardContext
from workers.runtime import ShardModel
from workers.sampling import sample


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to start; picklable for `spawn`."""

    shard_path: str
    shm_name: str
    input_bytes: int
    output_bytes: int
    n_threads: int
    flash_attn: bool
    parent_pid: int
    n_gpu_layers: int = 0
    verbose: bool = False
    direct_address: str = ""  # the direct channel's abstract socket name ("" : no direct channel)
    max_n_ctx: int = 0  # the daemon's largest context (the direct channel checks appends as the daemon does)
    compute_lock_path: str = ""  # at most compute_slots workers of the daemon compute at once ("": no limit)
    compute_slots: int = 1
    worker_index: int = 0
    seqs_per_worker: int = 0  # > 0: a batched worker, one context of this many sequences of max_n_ctx positions each
    frame_deadline_s: float = FRAME_DEADLINE_S  # a direct channel's frame (request or reply) passes whole within this, or its peer is dropped


PARENT_CHECK_INTERVAL_S = 0.2


def _exit_with_parent(parent_pid: int) -> None:
    """Exit the whole process as soon as `parent_pid` is no longer our parent (it died: we were re-parented)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_INTERVAL_S)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="kvpool-parent-watch", daemon=True).start()


def anonymous_bytes(pid: int | str = "self") -> int:
    """A process's anonymous memory (what contexts allocate; the mmap'd weights left out), from
    /proc/<pid>/smaps_rollup; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def worker_main(connection: Connection, spec: WorkerSpec, cancel_connection: Connection | None = None) -> None:
    _exit_with_parent(spec.parent_pid)
    # The supervisor owns shutdown: a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    encoder = msgspec.msgpack.Encoder()
    # The supervisor created the segment and unlinks it; a spawned worker shares the supervisor's
    # resource tracker, so attaching here registers nothing new.
    segment = shared_memory.SharedMemory(name=spec.shm_name)
    try:
        model = ShardModel(
            spec.shard_path,
            n_threads=spec.n_threads,
            flash_attn=spec.flash_attn,
            n_gpu_layers=spec.n_gpu_layers,
            verbose=spec.verbose,
        )
    except Exception as error:  # noqa: BLE001 - reported to the supervisor, which refuses to start
        connection.send_bytes(encoder.encode(Failed(code="load_failed", message=str(error))))
        return
    before = anonymous_bytes()
    try:
        server = BatchedWorkerServer(model, segment, spec) if spec.seqs_per_worker else WorkerServer(model, segment, spec)
    except Exception as error:  # noqa: BLE001 - reported to the supervisor, which refuses to start
        connection.send_bytes(encoder.encode(Failed(code="load_failed", message=f"creating the batched context: {error}")))
        model.close()
        return
    server.release_free_heap()  # so the supervisor's baseline reading is the settled one
    connection.send_bytes(
        encoder.encode(
            Ready(
                pid=os.getpid(),
                shape=model.layout,
                kv_bytes_per_position=model.kv_bytes_per_position(),
                context_bytes=max(anonymous_bytes() - before, 0) if spec.seqs_per_worker else 0,
            )
        )
    )
    selector = selectors.DefaultSelector()
    selector.register(connection.fileno(), selectors.EVENT_READ, None)
    channel = DirectChannel(spec.direct_address, server, segment, cancel_connection, selector, spec.frame_deadline_s) if spec.direct_address else None
    try:
        _obey(connection, server, channel, selector)
    finally:
        # Every view of the segment goes before it closes (a view left over makes close() fail).
        if channel is not None:
            channel.close()
        server.close()
        model.close()
        selector.close()
        segment.close()


def _obey(connection: Connection, server: WorkerServer | BatchedWorkerServer, channel: DirectChannel | None, selector: selectors.BaseSelector) -> None:
    """Obey the pipe, and serve the direct channel between its commands, until Exit or the pipe's EOF. The
    loop never waits on a peer (workers.direct): only in select, where the time counts against the frames
    passing on the channel."""
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(AnyCommand)
    while True:
        wait = channel.next_wait() if channel is not None else None
        before = time.monotonic()
        events = selector.select(wait)
        if channel is not None:
            channel.waited(time.monotonic() - before)
        for key, ready in events:
            if key.data is not None:
                channel.ready(key.data, ready)
                continue
            try:
                command = decoder.decode(connection.recv_bytes())
            except EOFError:
                return  # the supervisor is gone
            if isinstance(command, Exit):
                return
            connection.send_bytes(encoder.encode(server.handle(command)))


class WorkerServer:
    """Executes commands against the model and its one optional context."""

    def __init__(self, model: ShardModel, segment: shared_memory.SharedMemory, spec: WorkerSpec) -> None:
        self.model = model
        self.spec = spec
        self.context: ShardContext | None = None
        self._buffer = segment.buf
        self._abort_flag_address = ctypes.addressof(ctypes.c_char.from_buffer(segment.buf, ABORT_FLAG_OFFSET))
        libc_name = ctypes.util.find_library("c")
        self._malloc_trim = getattr(ctypes.CDLL(libc_name), "malloc_trim", None) if libc_name else None
        self.bound: tuple[str, int] | None = None  # the session the direct channel serves
        self.compute = (
            ComputeLocks(spec.compute_lock_path, spec.compute_slots, spec.worker_index) if spec.compute_lock_path else contextlib.nullcontext()
        )

    def release_free_heap(self) -> None:
        """Hand freed heap pages back to the OS (glibc keeps them otherwise): measured memory then
        falls back after a context is freed, instead of creeping up context after context."""
        if self._malloc_trim is not None:
            self._malloc_trim(0)

    def handle(self, command: AnyCommand):
        if not isinstance(command, BindChannel):
            self.bound = None  # every supervisor command revokes the direct channel first
        match command:
            case BindChannel(session_id=session_id, epoch=epoch):
                if self.context is None:
                    return Failed(code="no_context", message="no open context")
                self.bound = (session_id, epoch)
                return ChannelState(length=self.context.length)
            case RevokeChannel():
                return ChannelState(length=self.context.length if self.context is not None else 0)
            case OpenContext(n_ctx=n_ctx):
                return self._open(n_ctx)
            case RunAppend():
                return self._append(command)
            case TruncateContext(length=length):
                if self.context is None:
                    return Failed(code="no_context", message="no open context")
                try:
                    return Truncated(length=self.context.truncate(length))
                except ShardRuntimeError as error:
                    return Failed(code=error.code, message=str(error), length=error.length)
            case CloseContext():
                self._close_context()
                return Closed()
            case SaveState():
                if self.context is None:
                    return Failed(code="no_context", message="no open context")
                return Saved(length=self.context.length, blob=self.context.save_state())
            case RestoreState():
                return self._restore(command)
        return Failed(code="bad_command", message=f"unknown command {type(command).__name__}")

    def _open(self, n_ctx: int):
        self._close_context()
        try:
            self.context = self.model.new_context(n_ctx, abort_flag_address=self._abort_flag_address)
        except (MemoryError, ValueError) as error:
            return Failed(code="open_failed", message=str(error))
        return Opened(n_ctx=n_ctx)

    def _restore(self, command: RestoreState):
        opened = self._open(command.n_ctx)
        if isinstance(opened, Failed):
            return opened
        try:
            return Restored(length=self.context.restore_state(command.blob, command.length))
        except ShardRuntimeError as error:
            self._close_context()  # a refused restore may leave corrupt KV: never reuse this context
            return Failed(code="restore_failed", message=str(error), length=0)

    def _append(self, command: RunAppend):
        context = self.context
        if context is None:
            return Failed(code="no_context", message="no open context")
        layout = self.model.layout
        n_rows = command.n_rows
        try:
            if layout.is_first:
                if n_rows * 4 > self.spec.input_bytes:
                    return Failed(code="bad_request", message="too many rows", length=context.length)
                rows = np.frombuffer(self._buffer, np.int32, n_rows, CONTROL_BYTES)
                kwargs = {"tokens": rows}
            else:
                if n_rows * layout.n_embd * 4 > self.spec.input_bytes:
                    return Failed(code="bad_request", message="too many rows", length=context.length)
                rows = np.frombuffer(self._buffer, np.float32, n_rows * layout.n_embd, CONTROL_BYTES)
                kwargs = {"hidden": rows.reshape(n_rows, layout.n_embd)}
            out_rows = 1 if layout.is_last and command.output_rows != "all" else n_rows
            width = layout.output_width
            inline = out_rows * width * 4 > self.spec.output_bytes
            if inline:
                out = np.empty((out_rows, width), np.float32)
            else:
                out = np.frombuffer(
                    self._buffer, np.float32, out_rows * width, CONTROL_BYTES + self.spec.input_bytes
                ).reshape(out_rows, width)
            with self.compute:
                context.append(command.start_pos, output_rows=command.output_rows, out=out, **kwargs)
        except ShardRuntimeError as error:
            return Failed(code=error.code, message=str(error), length=error.length)
        if command.sample is not None:
            picked = sample(out[-1], command.sample, context.length)
            returned = out_rows if command.sample.logits else 0
            return Appended(
                length=context.length, rows=returned, width=width, inline=out.tobytes() if inline and returned else b"",
                token=picked.token, top_ids=picked.top_ids, top_logprobs=picked.top_logprobs,
            )
        return Appended(length=context.length, rows=out_rows, width=width, inline=out.tobytes() if inline else b"")

    def _close_context(self) -> None:
        if self.context is not None:
            self.context.close()
            self.context = None
            self.release_free_heap()

    def close(self) -> None:
        self._close_context()

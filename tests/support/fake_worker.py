"""A test double of kvpool's own worker process, never of llama.cpp: it answers the pipe commands of
workers.server.commands (AnyCommand -> AnyWorkerReply) in a thread of the test's process, over the same
pipe and shared-memory segment the real worker uses, and is plugged into the pool through PoolSpec.kinds.
So the supervisor, the books, the gate, admission, parking, housekeeping, transfers, the drain and the
protocol run for real, in milliseconds, without a model. Exactness is tested on the real model elsewhere.

What it computes is a pure function of each sequence's history, so a test can tell one history from
another bit for bit: the "KV" of position p is the chain digest sha256(kv[p-1] + the row's bytes), and the
output row of position p is float32 noise seeded by that digest (`expected_rows`). Its saved states are
real llama.cpp sequence states in layout (kvpool.state.sequence: one stream, positions [0, n), one layer
whose K and V rows are the digests), so check_cells, the seal, export, import and re-slicing treat them
as they treat llama.cpp's. Memory: a context "allocates" n_ctx x kv_bytes_per_position when it opens, as
llama.cpp does, and the worker reports that as its anonymous memory, so calibration fits real charges; a
parked or released context kept as the spare (SaveState.keep, CloseContext.keep; process mode) still holds its n_ctx's memory until an
open of that n_ctx takes it (Opened.reused / Restored.reused) or another n_ctx or CloseContext frees it;
a park's keeps the parked sequence's cells too, and the RestoreState naming that park's token resumes them without
reading the blob (Restored.in_place), as the real worker does, until IDLE_ZERO_S after the park: from then on the
spare counts as zeroed (the real worker zeroes it once it has sat idle that long) and the restore loads the blob.

`fake_kinds(...)` gives the (process-mode, batched) classes for PoolSpec.kinds with behaviour knobs: a
delay per row (so a cancel or a drain meets an append in flight), and a hook to fail a command. One
worker can be stopped as SIGSTOP stops a real one (`FakeServer.stopped`, reached through
tests.support.fake_daemon.FakeDaemon.stopped): every command it takes then waits until it runs again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec
import numpy as np

from kvpool.daemon.pool.batched import BatchedWorker
from kvpool.daemon.pool.handle import WorkerHandle
from kvpool.shard.header import read_shard_info
from kvpool.state.sequence import CellRows, LayerKV, SequenceState, StateFormatError, Stream, parse_state, write_state
from kvpool.wire.checks import check_position, input_rows
from kvpool.wire.shape import ShardShape
from workers.runtime.errors import ShardRuntimeError, wire_checks
from workers.runtime.sampling import answer
from workers.server.commands import (
    OPEN_FAILED,
    RESTORE_FAILED,
    AnyCommand,
    AnyWorkerReply,
    Appended,
    BatchDone,
    BatchItem,
    BindChannel,
    ChannelState,
    CloseContext,
    Closed,
    Exit,
    Failed,
    OpenContext,
    Opened,
    Ready,
    Restored,
    RestoreState,
    RevokeChannel,
    RunAppend,
    RunBatch,
    Saved,
    SaveState,
    TruncateContext,
    Truncated,
)
from workers.server.pipe import received_command, send_reply
from workers.server.segment import ABORT_FLAG_OFFSET
from workers.server.single import IDLE_ZERO_S
from workers.server.spec import WorkerSpec

KV_ROW_BYTES = 32  # one sha256 digest per position, as K and as V of the state's one layer
GGML_F32 = 0  # the ggml type the state's rows are written as (32 bytes: 8 "floats")
BASE_MEMORY_BYTES = 8 << 20  # what a fake worker reports before any context


def kv_bytes_per_position(shape: ShardShape) -> int:
    """What a fake context charges per position: K and V of every local layer, as llama.cpp's would."""
    return 2 * KV_ROW_BYTES * shape.n_layers


def chain(previous: bytes, row: np.ndarray) -> bytes:
    return hashlib.sha256(previous + np.ascontiguousarray(row).tobytes()).digest()


def output_row(digest: bytes, width: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(width, dtype=np.float32)


def expected_rows(shape: ShardShape, rows: np.ndarray, *, output_rows: str = "last") -> np.ndarray:
    """What a fake worker of `shape` returns for a fresh session appending `rows` (in one or many appends):
    one row per input row, or the last one alone on a last shard (output_rows "last")."""
    digest, out = b"", []
    for row in rows:
        digest = chain(digest, row)
        out.append(output_row(digest, shape.output_width))
    out = np.stack(out)
    return out[-1:] if shape.is_last and output_rows != "all" else out


@dataclasses.dataclass(slots=True)
class Behaviour:
    """Knobs a test may turn while the daemon runs (every worker of the kinds shares one)."""

    row_delay_s: float = 0.0  # per row of an append: an append in flight lasts this long per row
    fail: Callable[[AnyCommand], Failed | None] | None = None  # a reply in place of the command's own, or None


class FakeSequence:
    """One context (process mode) or one sequence of the batched context: its n_ctx and its digests."""

    def __init__(self) -> None:
        self.n_ctx = 0  # 0: no session
        self.digests: list[bytes] = []

    @property
    def length(self) -> int:
        return len(self.digests)

    def open(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.digests = []

    def truncate(self, length: int) -> None:
        del self.digests[length:]

    def state(self, seq_id: int) -> bytes:
        n = self.length
        rows = np.frombuffer(b"".join(self.digests), np.uint8).reshape(n, KV_ROW_BYTES) if n else np.zeros((0, KV_ROW_BYTES), np.uint8)
        layer = LayerKV(CellRows(GGML_F32, KV_ROW_BYTES, rows.copy()), CellRows(GGML_F32, KV_ROW_BYTES, rows.copy()))
        stream = Stream(np.arange(n, dtype=np.int32), ((seq_id,),) * n, False, (layer,) if n else ())
        return write_state(SequenceState(seq_id, (stream,)))

    def restore(self, blob: bytes, length: int, n_ctx: int) -> None:
        """As llama.cpp does: whatever positions the cells name, in their order (the daemon checks them first)."""
        state = parse_state(blob)
        cells = [(int(position), bytes(row)) for stream in state.streams if stream.n_cells
                 for position, row in zip(stream.positions, stream.layers[0].k.data)]
        cells.sort()
        if len(cells) < length or length > n_ctx:
            raise StateFormatError(f"the saved state holds {len(cells)} positions, {length} expected")
        self.n_ctx = n_ctx
        self.digests = [row for _position, row in cells[:length]]


class FakeServer:
    """What a worker process serves, on fake sequences: `n_seqs` 0 is process mode (one context)."""

    def __init__(self, shape: ShardShape, spec: WorkerSpec, buffer: memoryview, behaviour: Behaviour) -> None:
        self.shape = shape
        self.spec = spec
        self.behaviour = behaviour
        self.batched = spec.seqs_per_worker > 0
        self.sequences = [FakeSequence() for _ in range(max(spec.seqs_per_worker, 1))]
        self.spare_n_ctx = 0  # process mode: the n_ctx of the spare context (0: none)
        self.spare_cells: tuple[int, list[bytes]] | None = None  # the park's token and the cells its spare still holds
        self.spare_zero_due = 0.0  # time.monotonic() from which the spare counts as zeroed (workers.server.single.IDLE_ZERO_S)
        self.running = threading.Event()  # cleared: stopped, as SIGSTOP stops a worker (see `stopped`)
        self.running.set()
        self.killed = threading.Event()  # set by FakeProcess.kill: a stopped worker is killed too
        regions = spec.segment
        self._abort = np.frombuffer(buffer, np.int32, 1, ABORT_FLAG_OFFSET)
        self._input = buffer[regions.input_offset : regions.output_offset]
        self._output = buffer[regions.output_offset : regions.total_bytes]

    @contextlib.contextmanager
    def stopped(self):
        """Inside the block every command this worker takes waits (the one it is handling, if any, finishes
        first): it stays in flight for as long as the test wants, and runs once the block ends."""
        self.running.clear()
        try:
            yield self
        finally:
            self.running.set()

    def wait_while_stopped(self) -> None:
        while not self.running.wait(0.01) and not self.killed.is_set():
            pass

    def memory_bytes(self) -> int:
        per_position = kv_bytes_per_position(self.shape)
        if self.batched:
            return BASE_MEMORY_BYTES + len(self.sequences) * self.spec.max_n_ctx * per_position
        return BASE_MEMORY_BYTES + (self.sequences[0].n_ctx + self.spare_n_ctx) * per_position

    def handle(self, command: AnyCommand) -> AnyWorkerReply:
        if self.behaviour.fail is not None and (failed := self.behaviour.fail(command)) is not None:
            return failed
        seq = getattr(command, "seq", 0)
        if not 0 <= seq < len(self.sequences):
            return Failed(code="bad_command", message=f"no sequence {seq} in this worker")
        sequence = self.sequences[seq]
        match command:
            case BindChannel() | RevokeChannel():
                return ChannelState(length=self.sequences[0].length if not self.batched else 0)
            case OpenContext(n_ctx=n_ctx):
                return self._open(sequence, n_ctx)
            case RunAppend():
                restored, opened = None, None
                if command.restore is not None:
                    if isinstance(restored := self._restore(sequence, command.restore), Failed):
                        return restored
                elif command.n_ctx and isinstance(opened := self._open(sequence, command.n_ctx), Failed):
                    return opened
                appended = self._append(sequence, seq, command.start_pos, command.n_rows, 0, command.output_rows, command.sample, len(self._output), 0)
                if isinstance(appended, Appended):
                    appended.restored = restored
                    appended.reused = opened is not None and opened.reused
                return appended
            case RunBatch(items=items):
                return BatchDone(results=[self._item(item) for item in items])
            case TruncateContext(length=length):
                if not sequence.n_ctx:
                    return Failed(code="no_context", message="no open context")
                if not 0 <= length <= sequence.length:
                    return Failed(code="position_mismatch", message=f"cannot truncate to {length}: session length is {sequence.length}", length=sequence.length)
                sequence.truncate(length)
                return Truncated(length=sequence.length)
            case CloseContext(keep=True):
                if self.batched:
                    return Failed(code="bad_command", message="a batched worker keeps no spare context")
                if not sequence.n_ctx:  # as the real worker: nothing open, nothing kept, the spare left as it is
                    return Failed(code="no_context", message="no open context to keep")
                self.spare_n_ctx, self.spare_cells = sequence.n_ctx, None  # the open context becomes the spare, its cells no park's
                self.spare_zero_due = time.monotonic() + IDLE_ZERO_S
                sequence.open(0)
                return Closed()
            case CloseContext():
                sequence.open(0)
                self.spare_n_ctx, self.spare_cells = 0, None
                return Closed()
            case SaveState(keep=keep, head=head, tail=tail, owner=owner):
                if not sequence.n_ctx:
                    return Failed(code="no_context", message="no open context")
                if keep and self.batched:
                    return Failed(code="bad_command", message="a batched worker keeps no spare context")
                room = {} if self.batched else {"head": head, "tail": tail}  # as the real ones: a batched worker leaves no room
                saved = Saved(length=sequence.length, blob=sequence.state(seq), **room)
                if keep:
                    self.spare_n_ctx = sequence.n_ctx
                    self.spare_cells = (owner, list(sequence.digests)) if owner else None
                    self.spare_zero_due = time.monotonic() + IDLE_ZERO_S
                    sequence.open(0)
                return saved
            case RestoreState():
                return self._restore(sequence, command)
        return Failed(code="bad_command", message=f"a fake worker does not take {type(command).__name__}")

    def _restore(self, sequence: FakeSequence, command: RestoreState) -> Restored | Failed:
        """A RestoreState's, alone or carried by a RunAppend."""
        cells = self.spare_cells if time.monotonic() < self.spare_zero_due else None
        reused = self._take_spare(command.n_ctx)
        sequence.open(0)
        owner, length = command.owner, command.length
        if reused and owner and cells is not None and cells[0] == owner and length <= len(cells[1]):
            sequence.n_ctx, sequence.digests = command.n_ctx, cells[1][:length]  # its own park's cells: the blob is not read
            return Restored(length=sequence.length, reused=True, in_place=True)
        try:
            sequence.restore(bytes(command.blob), length, command.n_ctx)
        except StateFormatError as error:
            sequence.open(0)
            return Failed(code=RESTORE_FAILED, message=str(error), length=0)
        return Restored(length=sequence.length, reused=reused)

    def _open(self, sequence: FakeSequence, n_ctx: int) -> Opened | Failed:
        if self.batched and not 1 <= n_ctx <= self.spec.max_n_ctx:
            return Failed(code=OPEN_FAILED, message=f"n_ctx {n_ctx} is beyond this worker's {self.spec.max_n_ctx} per sequence")
        reused = self._take_spare(n_ctx)
        sequence.open(n_ctx)
        return Opened(n_ctx=n_ctx, reused=reused)

    def _take_spare(self, n_ctx: int) -> bool:
        """As the real worker: a spare of this n_ctx becomes the context; any other is freed."""
        reused = self.spare_n_ctx == n_ctx
        self.spare_n_ctx, self.spare_cells = 0, None
        return reused

    def _item(self, item: BatchItem) -> Appended | Failed:
        if not 0 <= item.seq < len(self.sequences):
            return Failed(code="bad_command", message=f"no sequence {item.seq} in this worker")
        sequence = self.sequences[item.seq]
        return self._append(sequence, item.seq, item.start_pos, item.n_rows, item.input_offset, item.output_rows, item.sample,
                            item.output_capacity, item.output_offset)

    def _append(self, sequence, seq, start_pos, n_rows, input_offset, output_rows, sample, capacity, output_offset) -> Appended | Failed:
        if not sequence.n_ctx:
            return Failed(code="no_context", message=f"sequence {seq} serves no session", length=sequence.length)
        try:
            with wire_checks():
                check_position(start_pos, sequence.length, n_rows, sequence.n_ctx)
                rows = input_rows(self._input, self.shape, n_rows, input_offset, length=sequence.length)
        except ShardRuntimeError as error:
            return Failed(code=error.code, message=str(error), length=error.length)
        previous = sequence.digests[-1] if sequence.digests else b""
        out = []
        for row in rows:
            if self._abort[0]:
                sequence.truncate(start_pos)
                return Failed(code="cancelled", message="the append was cancelled", length=start_pos)
            if self.behaviour.row_delay_s:
                threading.Event().wait(self.behaviour.row_delay_s)
            previous = chain(previous, row)
            sequence.digests.append(previous)
            out.append(output_row(previous, self.shape.output_width))
        computed = np.stack(out)
        if self.shape.is_last and output_rows != "all":
            computed = computed[-1:]
        reply = answer(computed, sample, sequence.length)
        data = reply.rows
        inline = b""
        if data.nbytes > capacity or output_offset + data.nbytes > len(self._output):
            inline = data.tobytes()
        elif data.nbytes:
            np.frombuffer(self._output, np.float32, data.size, output_offset)[:] = data.reshape(-1)
        return Appended(length=sequence.length, rows=data.shape[0], width=computed.shape[1], inline=inline,
                        output_offset=output_offset if self.batched else 0, **reply.reply_fields)

    def close(self) -> None:
        del self._abort
        self._input.release()
        self._output.release()


class FakeProcess:
    """The process facade WorkerProcess uses (start, pid, exitcode, is_alive, join, terminate, kill), over a
    thread. kill() ends the thread at once, as SIGKILL ends a worker: its pipe reads EOF on the supervisor's end."""

    def __init__(self, name: str, serve: Callable[[], None], connection: Connection, killed: threading.Event | None = None) -> None:
        self._connection = connection
        self._killed = killed
        self._thread = threading.Thread(target=serve, name=f"fake-{name}", daemon=True)
        self.pid = os.getpid()
        self.killed = False

    def start(self) -> None:
        self._thread.start()

    @property
    def exitcode(self) -> int | None:
        return None if self._thread.is_alive() else (-9 if self.killed else 0)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def kill(self) -> None:
        self.killed = True
        if self._killed is not None:
            self._killed.set()
        try:  # wakes the thread's blocked read with EOF; the supervisor's end reads EOF too
            socket.socket(fileno=os.dup(self._connection.fileno())).shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    terminate = kill


class FakeWorkerMixin:
    """In place of a spawned worker process: a FakeServer in a thread on the child's ends of the pipes."""

    behaviour = Behaviour()

    def _start(self, context, worker_spec: WorkerSpec, child_end: Connection, child_cancel_end: Connection) -> FakeProcess:
        shape = read_shard_info(worker_spec.shard_path).shape
        server = FakeServer(shape, worker_spec, self.shared.memory.buf, self.behaviour)
        self.fake_server = server
        ready = Ready(pid=os.getpid(), shape=shape, kv_bytes_per_position=kv_bytes_per_position(shape),
                      context_bytes=server.memory_bytes() - BASE_MEMORY_BYTES if server.batched else 0,
                      idle_spin=f"{worker_spec.idle_spin} times (a fake worker: no libgomp)")

        def serve() -> None:
            encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(AnyCommand)
            try:
                child_end.send_bytes(encoder.encode(ready))
                while True:
                    with received_command(child_end, decoder) as command:
                        if isinstance(command, Exit):
                            return
                        server.wait_while_stopped()
                        reply = server.handle(command)
                    send_reply(child_end, encoder, reply)
            except (EOFError, OSError):
                return
            finally:
                server.close()
                child_end.close()
                child_cancel_end.close()

        process = FakeProcess(self.name, serve, child_end, server.killed)
        process.start()
        return process

    @property
    def exited(self) -> bool:
        return not self.process.is_alive()

    def measure_uss(self) -> int:
        return self.fake_server.memory_bytes() if self.process.is_alive() else 0

    def measure_anonymous(self) -> int:
        return self.measure_uss()


class FakeWorkerHandle(FakeWorkerMixin, WorkerHandle):
    pass


class FakeBatchedWorker(FakeWorkerMixin, BatchedWorker):
    pass


def fake_kinds(**behaviour) -> tuple[type, type]:
    """PoolSpec.kinds for fake workers with `behaviour` (Behaviour's fields; `kinds[0].behaviour` turns them later)."""
    knobs = Behaviour(**behaviour)
    return (type("FakeWorker", (FakeWorkerHandle,), {"behaviour": knobs}),
            type("FakeBatched", (FakeBatchedWorker,), {"behaviour": knobs}))

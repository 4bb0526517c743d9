"""A worker that serves one session's context: the commands of the supervisor's pipe, on one llama context."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import time
from multiprocessing import shared_memory

import numpy as np

from kvpool.wire.checks import input_rows
from workers.runtime.context import ShardContext
from workers.runtime.errors import ShardRuntimeError, wire_checks
from workers.runtime.model import ShardModel
from workers.runtime.sampling import answer
from workers.server.background import Background, in_this_thread
from workers.server.commands import (
    OPEN_FAILED,
    RESTORE_FAILED,
    AnyCommand,
    Appended,
    BindChannel,
    ChannelState,
    CloseContext,
    Closed,
    Failed,
    OpenContext,
    Opened,
    Restored,
    RestoreState,
    RevokeChannel,
    RunAppend,
    Saved,
    SaveState,
    TruncateContext,
    Truncated,
)
from workers.server.compute_semaphore import ComputeSemaphore
from workers.server.pipe import WrittenState
from workers.server.segment import ABORT_FLAG_OFFSET
from workers.server.spec import WorkerSpec

IDLE_ZERO_S = 1.0  # how long a worker sits idle before it zeroes a spare its last session may come back to


class WorkerServer:
    """Executes commands against the model and its one optional context, and keeps a parked session's
    context as a spare for the next context of its n_ctx (SaveState.keep): a restore or an admission then
    creates nothing (13-17 ms at n_ctx 2112 on the bundled middle shard, evidence/warm-tier) and finds its
    buffers' pages already mapped; that park's own restore finds its cells too."""

    def __init__(self, model: ShardModel, segment: shared_memory.SharedMemory, spec: WorkerSpec) -> None:
        self.model = model
        self.spec = spec
        self.context: ShardContext | None = None
        self.spare: ShardContext | None = None  # not open: only _open takes it (its cells cleared unless _unzeroed)
        self._unzeroed: int | None = None  # an unzeroed spare's park token (0: none named); None: zeroed
        self._zero_due = 0.0
        self._buffer = segment.buf
        regions = spec.segment
        self._input = memoryview(segment.buf)[regions.input_offset : regions.output_offset]
        self._abort_flag_address = ctypes.addressof(ctypes.c_char.from_buffer(segment.buf, ABORT_FLAG_OFFSET))
        libc_name = ctypes.util.find_library("c")
        self._malloc_trim = getattr(ctypes.CDLL(libc_name), "malloc_trim", None) if libc_name else None
        self.bound: tuple[str, int] | None = None  # the session the direct channel serves
        self.background = Background(spec.background_nice) if spec.background_nice else None  # saves no caller waits for (SaveState.behind)
        self.compute = (
            ComputeSemaphore(spec.compute_semaphore) if spec.compute_semaphore >= 0 else contextlib.nullcontext()
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
                return self._run(command)
            case TruncateContext(length=length):
                if self.context is None:
                    return Failed(code="no_context", message="no open context")
                try:
                    return Truncated(length=self.context.truncate(length))
                except ShardRuntimeError as error:
                    return Failed(code=error.code, message=str(error), length=error.length)
            case CloseContext(keep=True):
                if self.context is None:  # nothing to keep (an admission's open not sent): the spare, if any, stays
                    return Failed(code="no_context", message="no open context to keep")
                self._keep_as_spare(0)  # a park's token is never 0: no restore takes it unzeroed
                return Closed()
            case CloseContext():
                self._close_context()
                self._close_spare()
                return Closed()
            case SaveState(keep=keep, head=head, tail=tail, owner=owner, behind=behind):
                if self.context is None:
                    return Failed(code="no_context", message="no open context")
                run = self.background.run if behind and self.background is not None else in_this_thread
                if head or tail:  # room asked for: llama.cpp writes straight into the memfd that travels
                    blob = WrittenState(*run(self.context.save_state_to_memfd, head, tail))
                else:
                    blob = run(self.context.save_state)
                saved = Saved(length=self.context.length, blob=blob, head=head, tail=tail)
                if keep:
                    self._keep_as_spare(owner)
                return saved
            case RestoreState(bind=bind):
                restored = self._restore(command)
                if bind is not None and isinstance(restored, Restored):
                    self.bound = (bind.session_id, bind.epoch)
                return restored
        return Failed(code="bad_command", message=f"unknown command {type(command).__name__}")

    def _run(self, command: RunAppend):
        """The append, after the fresh context it asks for (n_ctx) or the restore it carries, then the
        channel bound if it asks and the append succeeded."""
        restored = None
        reused = False
        if command.restore is not None:
            started = time.perf_counter()
            restored = self._restore(command.restore)
            if isinstance(restored, Failed):
                return restored
            restored.seconds = time.perf_counter() - started
        elif command.n_ctx:
            opened = self._open(command.n_ctx)
            if isinstance(opened, Failed):
                return opened
            reused = opened.reused
        appended = self._append(command)
        if isinstance(appended, Appended):
            appended.restored = restored
            appended.reused = reused
            if command.bind is not None:
                self.bound = (command.bind.session_id, command.bind.epoch)
        return appended

    def _keep_as_spare(self, owner: int) -> None:
        """The open context becomes the spare as it is, the parked sequence's cells and KV still in it, until
        it is zeroed (cells and buffers: a memset of the whole cache, 1.5-1.6 ms at n_ctx 2112 on the bundled
        middle shard, kept off the park): when the worker has sat idle IDLE_ZERO_S, or before any other
        session takes it. Only the restore of `owner`'s park takes it unzeroed, and then loads nothing: the
        cells that park saved are still there (_restore)."""
        self._close_spare()
        self.spare, self.context = self.context, None
        self._unzeroed = owner
        self._zero_due = time.monotonic() + IDLE_ZERO_S

    def idle_in(self, now: float) -> float | None:
        """Seconds until the worker has idle work due (0: now), None when it has none."""
        if self.spare is None or self._unzeroed is None:
            return None
        return max(self._zero_due - now, 0.0)

    def idle(self, now: float) -> None:
        """The idle work due at `now`: a spare's KV zeroed."""
        if self.spare is not None and self._zero_due <= now:
            self._zero(self.spare)

    def _zero(self, spare: ShardContext) -> None:
        if self._unzeroed is not None:
            spare.clear(data=True)
            self._unzeroed = None

    def _open(self, n_ctx: int, owner: int = 0) -> Opened | Failed:
        """A fresh context of n_ctx positions: the spare if it has that n_ctx (Opened.n_ctx then), else a new
        one once every other context is freed. The spare is zeroed first unless `owner` (a restore's park
        token) is the park whose KV it still holds: nothing of another session's is ever left in a context."""
        spare, self.spare = self.spare, None
        unzeroed, self._unzeroed = self._unzeroed, None
        self._close_context()
        if spare is not None and spare.n_ctx == n_ctx:
            if unzeroed is not None and (not owner or owner != unzeroed):
                spare.clear(data=True)
            self.context = spare
            return Opened(n_ctx=n_ctx, reused=True)
        if spare is not None:
            spare.close()
            self.release_free_heap()
        try:
            self.context = self.model.new_context(n_ctx, abort_flag_address=self._abort_flag_address)
        except (MemoryError, ValueError) as error:
            return Failed(code=OPEN_FAILED, message=str(error))
        return Opened(n_ctx=n_ctx)

    def _restore(self, command: RestoreState):
        """The parked session back in a context: into the spare its own park left, unzeroed, nothing is loaded
        (its cells are the ones that park saved, cut to `length`); anywhere else, the blob is. A spare whose
        cells do not hold what that park saved is cleared and loaded as any other."""
        own = command.owner != 0 and command.owner == self._unzeroed  # a spare _open reuses is then that park's, its cells in it
        opened = self._open(command.n_ctx, command.owner)
        if isinstance(opened, Failed):
            return opened
        if own and opened.reused:
            try:
                return Restored(length=self.context.resume(command.length), reused=True, in_place=True)
            except ShardRuntimeError:
                self.context.clear(data=True)
        try:
            return Restored(length=self.context.restore_state(command.blob, command.length), reused=opened.reused)
        except ShardRuntimeError as error:
            self._close_context()  # a refused restore may leave corrupt KV: never reuse this context
            return Failed(code=RESTORE_FAILED, message=str(error), length=0)

    def _append(self, command: RunAppend):
        context = self.context
        if context is None:
            return Failed(code="no_context", message="no open context")
        shape = self.model.shape
        n_rows = command.n_rows
        try:
            with wire_checks():
                rows = input_rows(self._input, shape, n_rows, 0, length=context.length)
            kwargs = {"tokens": rows} if shape.is_first else {"hidden": rows}
            out_rows, width = shape.output_shape(n_rows, command.output_rows)
            inline = out_rows * width * 4 > self.spec.output_bytes
            if inline:
                out = np.empty((out_rows, width), np.float32)
            else:
                out = np.frombuffer(
                    self._buffer, np.float32, out_rows * width, self.spec.segment.output_offset
                ).reshape(out_rows, width)
            with self.compute:
                context.append(command.start_pos, output_rows=command.output_rows, out=out, **kwargs)
        except ShardRuntimeError as error:
            return Failed(code=error.code, message=str(error), length=error.length)
        reply = answer(out, command.sample, context.length)
        return Appended(
            length=context.length, rows=reply.rows.shape[0], width=width, inline=reply.rows.tobytes() if inline else b"",
            **reply.reply_fields,
        )

    def _close_context(self) -> None:
        if self.context is not None:
            self.context.close()
            self.context = None
            self.release_free_heap()

    def _close_spare(self) -> None:
        self._unzeroed = None  # no spare, no park's cells
        if self.spare is not None:
            self.spare.close()
            self.spare = None
            self.release_free_heap()

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
        self._close_context()
        self._close_spare()
        self._input.release()  # the segment closes next: no view of it may outlive this

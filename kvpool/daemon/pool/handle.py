"""The supervisor's side of one worker process: a typed facade over its pipe and shared-memory segment.

Each call returns a value or raises WorkerFailed (the worker refused: code, length) or WorkerLost; nothing
else of the pipe protocol leaves this module. The process itself (start, pipe, stop) is
kvpool.daemon.pool.process; the segment's reads and writes are kvpool.daemon.pool.segment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpool.daemon.pool.errors import WorkerFailed, WorkerLost, WorkerStartFailed
from kvpool.daemon.pool.process import WorkerProcess
from kvpool.daemon.pool.spec import PoolSpec
from kvpool.state.shared import SharedPayload
from kvpool.wire.sampling import Sampling
from workers.server.commands import (
    AnyCommand,
    Appended,
    BindChannel,
    Binding,
    CancelDirect,
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
from workers.server.pipe import prepared_state

__all__ = ["PoolSpec", "WorkerFailed", "WorkerHandle", "WorkerLost", "WorkerOutput", "WorkerStartFailed"]


@dataclass(frozen=True, slots=True)
class WorkerOutput:
    length: int
    rows: int
    width: int
    data: bytes  # float32 little-endian [rows, width]
    token: int = -1  # with sampling: the token picked on the last shard
    top_ids: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[float] = dataclasses.field(default_factory=list)
    restored: Restored | None = None  # the restore the append carried (WorkerHandle.restore_with_append)
    reused: bool = False  # the context the append opened (WorkerHandle.open) was the worker's spare: none created


class WorkerHandle(WorkerProcess):
    """The supervisor's side of one worker process: open / append / truncate / close_context return
    values or raise WorkerFailed (the worker refused: code, length) or WorkerLost.

    An append is one pipe round trip: the open asked for before it travels with it (RunAppend.n_ctx), and
    so do a parked session's restore (RunAppend.restore) and the direct channel's binding (RunAppend.bind);
    the worker revokes the channel on every command."""

    restores_with_append = True  # restore_with_append: a parked session's restore travels with its next append

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._opening = 0  # open() asked for a context of this many positions, not sent yet
        self._restoring: RestoreState | None = None  # restore_with_append asked for it, not sent yet (its blob a StateDescriptor)

    async def _expect(self, command: AnyCommand, expected: type):
        if isinstance(command, RestoreState | CloseContext):
            self._opening = 0  # superseded: a fresh context of its own, or none
            self._drop_restoring()
        elif self._restoring is not None and not isinstance(command, RunAppend):
            restoring = self._take_restoring()
            try:
                await self._reply_to(restoring, Restored)  # as it would have been sent alone: its failure is this call's
            finally:
                restoring.blob.close()
        elif self._opening and not isinstance(command, RunAppend):
            await self._reply_to(OpenContext(n_ctx=self._take_opening()), Opened)
        return await self._reply_to(command, expected)

    def _take_opening(self) -> int:
        n_ctx, self._opening = self._opening, 0
        return n_ctx

    def _take_restoring(self) -> RestoreState | None:
        restoring, self._restoring = self._restoring, None
        return restoring

    def _drop_restoring(self) -> None:
        restoring = self._take_restoring()
        if restoring is not None:
            restoring.blob.close()

    async def _reply_to(self, command: AnyCommand, expected: type):
        reply = await self.call(command)
        if isinstance(reply, Failed):
            raise WorkerFailed(reply.code, reply.message, reply.length)
        if not isinstance(reply, expected):
            raise WorkerFailed("internal", f"{self.name} answered {type(command).__name__} with {type(reply).__name__}", 0)
        return reply

    async def open(self, n_ctx: int) -> None:
        """A fresh context of n_ctx positions (the previous one, if any, is freed first), opened by the worker
        with the next append, or before any other command; a failure is that command's (code open_failed)."""
        self._drop_restoring()  # superseded, as a CloseContext supersedes it
        self._opening = n_ctx

    async def append(
        self, start_pos: int, rows: np.ndarray, output_rows: str = "last", sample: Sampling | None = None, *, bind: Binding | None = None,
        still_wanted: Callable[[], None] | None = None,
    ) -> WorkerOutput:
        """Append rows (int32 token ids on a first shard, float32 [n, n_embd] hidden states elsewhere);
        with `sample` (last shard) the worker picks the next token; with `bind` its direct channel serves
        that session afterwards, if the append succeeded. `still_wanted` raises when the append may no
        longer run; it is called as the command is sent (after every wait: a compute slot, a batch)."""
        if still_wanted is not None:
            still_wanted()
        self.shared.write_input(rows)
        restoring = self._take_restoring()
        command = RunAppend(
            start_pos=start_pos, n_rows=len(rows), output_rows=output_rows, sample=sample, n_ctx=self._take_opening(), bind=bind, restore=restoring,
        )
        try:
            appended = await self._expect(command, Appended)
        finally:
            if restoring is not None:
                restoring.blob.close()  # sent (the pipe closed it) or not: never left open
        return WorkerOutput(
            length=appended.length, rows=appended.rows, width=appended.width, data=self.shared.read_output(appended),
            token=appended.token, top_ids=appended.top_ids, top_logprobs=appended.top_logprobs, restored=appended.restored,
            reused=appended.reused,
        )

    async def truncate(self, length: int) -> int:
        return (await self._expect(TruncateContext(length=length), Truncated)).length

    async def close_context(self, *, keep: bool = False) -> None:
        """The context freed; with `keep` kept as the worker's spare (workers.server.commands.CloseContext)."""
        await self._expect(CloseContext(keep=keep), Closed)

    async def save_state(self, *, keep: bool = False, head: int = 0, tail: int = 0, owner: int = 0, behind: bool = False) -> Saved:
        """The open context's sequence state (positions [0, Saved.length): the worker's length, a direct append
        that reached it first included) in Saved.blob; with `keep` the context is then kept as the worker's
        spare, its cells in it, for the restore that names the park token `owner` (workers.server.commands.SaveState):
        none is open afterwards. With room asked for around the bytes (`head`, `tail`), the blob is a SharedState
        of the worker's memfd when this process may keep one more (workers.server.pipe), else the bytes. `behind`:
        no caller waits for it; the worker saves at a lower CPU priority (workers.server.background)."""
        return await self._expect(SaveState(keep=keep, head=head, tail=tail, owner=owner, behind=behind), Saved)

    async def restore_state(
        self, n_ctx: int, blob: bytes | memoryview | SharedPayload, length: int, owner: int = 0, *, bind: Binding | None = None,
    ) -> Restored:
        """A fresh context (the spare if it has n_ctx: Restored.reused) loaded with `blob`, cut to `length`;
        WorkerFailed code restore_failed if refused. `owner`: the park token of the state restored (the spare
        that park left, unzeroed, resumes its cells and the blob is not read: Restored.in_place). With `bind` the
        direct channel serves that session afterwards, if the restore succeeded."""
        return await self._expect(RestoreState(n_ctx=n_ctx, blob=blob, length=length, owner=owner, bind=bind), Restored)

    def restore_with_append(self, n_ctx: int, blob: bytes | memoryview | SharedPayload, length: int, owner: int = 0) -> None:
        """restore_state's command, sent with the next append (RunAppend.restore: one round trip for both;
        WorkerOutput.restored then says how it went, and a refusal is that append's WorkerFailed, code
        restore_failed or open_failed), or alone before any other command; a CloseContext or another restore
        drops it. The blob is made ready to travel here (workers.server.pipe.prepared_state): the caller may
        close it at once."""
        self._drop_restoring()
        self._opening = 0
        self._restoring = RestoreState(n_ctx=n_ctx, blob=prepared_state(blob), length=length, owner=owner)

    async def bind_channel(self, bind: Binding) -> int:
        """Serve `bind`'s session from the direct channel again (after a command that revoked it); returns the length."""
        return (await self._expect(BindChannel(session_id=bind.session_id, epoch=bind.epoch), ChannelState)).length

    async def revoke_channel(self) -> int:
        """No more direct appends (one in flight completes first); returns the context's length."""
        return (await self._expect(RevokeChannel(), ChannelState)).length

    def cancel_direct(self, session_id: str, epoch: int, request_id: int) -> None:
        """Forward a cancel of the direct append `request_id` to the worker's cancel thread (no reply awaited)."""
        self.send_cancel(CancelDirect(session_id=session_id, epoch=epoch, request_id=request_id))

    def set_abort(self, value: bool) -> None:
        self.shared.set_abort(value)

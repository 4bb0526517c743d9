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


class WorkerHandle(WorkerProcess):
    """The supervisor's side of one worker process: open / append / truncate / close_context return
    values or raise WorkerFailed (the worker refused: code, length) or WorkerLost.

    An append is one pipe round trip: the open asked for before it travels with it (RunAppend.n_ctx), and
    so does the direct channel's binding (RunAppend.bind); the worker revokes the channel on every command."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._opening = 0  # open() asked for a context of this many positions, not sent yet

    async def _expect(self, command: AnyCommand, expected: type):
        if isinstance(command, RestoreState | CloseContext):
            self._opening = 0  # superseded: a fresh context of its own, or none
        elif self._opening and not isinstance(command, RunAppend):
            await self._reply_to(OpenContext(n_ctx=self._take_opening()), Opened)
        return await self._reply_to(command, expected)

    def _take_opening(self) -> int:
        n_ctx, self._opening = self._opening, 0
        return n_ctx

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
        command = RunAppend(start_pos=start_pos, n_rows=len(rows), output_rows=output_rows, sample=sample, n_ctx=self._take_opening(), bind=bind)
        appended = await self._expect(command, Appended)
        return WorkerOutput(
            length=appended.length, rows=appended.rows, width=appended.width, data=self.shared.read_output(appended),
            token=appended.token, top_ids=appended.top_ids, top_logprobs=appended.top_logprobs,
        )

    async def truncate(self, length: int) -> int:
        return (await self._expect(TruncateContext(length=length), Truncated)).length

    async def close_context(self) -> None:
        await self._expect(CloseContext(), Closed)

    async def save_state(self, *, keep: bool = False, head: int = 0, tail: int = 0, owner: int = 0) -> Saved:
        """The open context's sequence state (positions [0, Saved.length): the worker's length, a direct append
        that reached it first included) in Saved.blob; with `keep` the context is then kept as the worker's
        spare, its cells in it, for the restore that names the park token `owner` (workers.server.commands.SaveState):
        none is open afterwards. With room asked for around the bytes (`head`, `tail`), the blob is a SharedState
        of the worker's memfd when this process may keep one more (workers.server.pipe), else the bytes."""
        return await self._expect(SaveState(keep=keep, head=head, tail=tail, owner=owner), Saved)

    async def restore_state(self, n_ctx: int, blob: bytes | memoryview | SharedPayload, length: int, owner: int = 0) -> Restored:
        """A fresh context (the spare if it has n_ctx: Restored.reused) loaded with `blob`, cut to `length`;
        WorkerFailed code restore_failed if refused. `owner`: the park token of the state restored (the spare
        that park left, unzeroed, resumes its cells and the blob is not read: Restored.in_place)."""
        return await self._expect(RestoreState(n_ctx=n_ctx, blob=blob, length=length, owner=owner), Restored)

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

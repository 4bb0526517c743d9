"""One sequence of a batched worker process (kvpool.batched_worker), lent by the pool as a worker: the
WorkerHandle calls, on its sequence only; what belongs to the process (pid, lost, memory, segment) is
the process's, shared by its slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool.worker_handle import WorkerFailed, WorkerOutput
from workers.commands import (
    CloseContext,
    Closed,
    Opened,
    OpenContext,
    Restored,
    RestoreState,
    Saved,
    SaveState,
    Truncated,
    TruncateContext,
)
from workers.sampling import Sampling

if TYPE_CHECKING:
    from kvpool.batched_worker import BatchedWorker


class SequenceSlot:
    """One sequence of a batched worker, lent by the pool as a worker: the WorkerHandle calls, on its
    sequence only. Its process's life (lost, exited, stopped) is the slot's."""

    def __init__(self, process: BatchedWorker, seq: int) -> None:
        self.process = process
        self.seq = seq
        self.name = f"{process.name}/seq{seq}"
        self.direct_address = ""

    # ---- the process, shared by the slots --------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def lost(self) -> bool:
        return self.process.lost

    @lost.setter
    def lost(self, value: bool) -> None:
        self.process.lost = value

    @property
    def exited(self) -> bool:
        return self.process.exited

    @property
    def ready(self):
        return self.process.ready

    @property
    def direct(self):
        return self.process.direct

    @property
    def baseline_uss(self) -> int:
        """This slot's share of the process's start-up USS."""
        return self.process.baseline_uss // len(self.process.slots)

    def measure_uss(self) -> int:
        """This slot's share of the process's USS (the slots' shares add up to the process's)."""
        return self.process.measure_uss() // len(self.process.slots)

    def measure_anonymous(self) -> int:
        return self.process.measure_anonymous()

    # ---- the sequence ------------------------------------------------------------------------------

    async def open(self, n_ctx: int) -> None:
        await self.process._expect(OpenContext(n_ctx=n_ctx, seq=self.seq), Opened)

    async def append(self, start_pos: int, rows: np.ndarray, output_rows: str = "last", sample: Sampling | None = None) -> WorkerOutput:
        return await self.process.append_seq(self.seq, start_pos, rows, output_rows, sample)

    async def truncate(self, length: int) -> int:
        return (await self.process._expect(TruncateContext(length=length, seq=self.seq), Truncated)).length

    async def close_context(self) -> None:
        self.process.forget_seq(self.seq)
        await self.process._expect(CloseContext(seq=self.seq), Closed)

    async def save_state(self) -> bytes:
        return (await self.process._expect(SaveState(seq=self.seq), Saved)).blob

    async def restore_state(self, n_ctx: int, blob: bytes, length: int) -> int:
        return (await self.process._expect(RestoreState(n_ctx=n_ctx, blob=blob, length=length, seq=self.seq), Restored)).length

    async def bind_channel(self, session_id: str, epoch: int) -> int:
        raise WorkerFailed("internal", "a batched worker has no direct channel", 0)

    async def revoke_channel(self) -> int:
        raise WorkerFailed("internal", "a batched worker has no direct channel", 0)

    def cancel_direct(self, session_id: str, epoch: int, request_id: int) -> None:
        pass  # no direct channel: nothing is in flight there

    def set_abort(self, value: bool) -> None:
        self.process.cancel_seq(self.seq, value)

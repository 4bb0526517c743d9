"""The supervisor's side of a batched worker (workers.server.batched_server): one process, one context, and one
SequenceSlot per sequence (below: one sequence lent by the pool as a worker, the WorkerHandle calls on its
sequence only; what belongs to the process, pid, lost, memory, segment, is the process's). To the books and the service a slot is a worker like any other (it has the
WorkerHandle calls); the slots of one process share its pipe, and their appends are decoded together.

The batcher: appends of a process's slots wait in one queue; whenever the pipe is free, everything
queued (what fits the shared-memory regions, one append per sequence) goes as one RunBatch, under one
compute slot. While a batch computes, the next one gathers; before sending, it waits a little (a
quarter of the last batch's compute at most) for the sessions that were in the last batch to queue
again, so sessions stepping together stay in one batch.

Cancel is per session: a queued append is taken out and answered cancelled; a computing one is marked,
and the shared decode is aborted only when every session in it is cancelled, otherwise the cancelled
session's rows are rolled back when the batch ends and the others keep theirs. An append whose awaiting
request is gone (its client left) is rolled back the same way, so the books' length stays the worker's.
The rolled-back appends of a batch are answered only once all its rollbacks have reached the worker: a session
told "cancelled" may send its next command at once (a park's save; a release, then another session's restore
into the freed sequence), and no rollback may come after it on that sequence.

Every append the batcher holds is answered: an error other than the worker's own (WorkerLost, WorkerFailed)
answers the batch and the queue WorkerLost, and the process counts as lost (the pool replaces it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from kvpool.daemon.pool.compute import ComputeSlots
from kvpool.daemon.pool.handle import PoolSpec, WorkerFailed, WorkerHandle, WorkerLost, WorkerOutput
from kvpool.state.shared import SharedPayload
from kvpool.wire.sampling import Sampling
from workers.server.commands import (
    Appended,
    BatchDone,
    BatchItem,
    Binding,
    CloseContext,
    Closed,
    Failed,
    OpenContext,
    Opened,
    Restored,
    RestoreState,
    RunBatch,
    Saved,
    SaveState,
    TruncateContext,
    Truncated,
)

MIN_GATHER_S = 0.002  # how long a batch may wait for the last batch's other sessions to queue again
MAX_GATHER_S = 0.05

log = logging.getLogger("kvpool.serve")


@dataclasses.dataclass(eq=False)
class PendingAppend:
    seq: int
    start_pos: int
    rows: np.ndarray
    output_rows: str
    sample: Sampling | None
    future: asyncio.Future
    cancelled: bool = False
    still_wanted: Callable[[], None] | None = None  # raises when the append may no longer run (its epoch is stale)


NO_CHANNEL = "a batched worker has no direct channel"


class BatchedWorker(WorkerHandle):
    """One batched worker process; `slots` are what the pool lends."""

    def __init__(self, name: str, spec: PoolSpec, index: int = 0, *, compute: ComputeSlots | None = None) -> None:
        super().__init__(name, spec, index)
        self.compute = compute or ComputeSlots(1)
        self.slots = [SequenceSlot(self, seq) for seq in range(spec.worker.seqs_per_worker)]
        self.batches = 0  # RunBatch calls so far, and their items (for stats and tests)
        self.batched_items = 0
        self._queue: list[PendingAppend] = []
        self._computing: list[PendingAppend] = []
        self._last_batch_seqs: set[int] = set()
        self._batcher: asyncio.Task | None = None
        self._arrived = asyncio.Event()
        self._last_batch_s = 0.0  # how long the last RunBatch took

    async def append_seq(
        self, seq: int, start_pos: int, rows: np.ndarray, output_rows: str, sample: Sampling | None,
        still_wanted: Callable[[], None] | None = None,
    ) -> WorkerOutput:
        if self.lost:
            raise WorkerLost(f"{self.name} is lost")
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda done: done.cancelled() or done.exception())  # read even when nobody awaits it
        pending = PendingAppend(seq, start_pos, rows, output_rows, sample, future, still_wanted=still_wanted)
        self._queue.append(pending)
        self._arrived.set()
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.get_running_loop().create_task(self._run_batches())
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            pending.cancelled = True  # rolled back when its batch ends; taken out if it has not started
            if pending in self._queue:
                self._queue.remove(pending)
            raise

    def cancel_seq(self, seq: int, value: bool) -> None:
        """A cancel of the session on `seq` (value False: a stale cancel mark is cleared)."""
        if not value:
            return
        for pending in list(self._queue):
            if pending.seq == seq:
                self._queue.remove(pending)
                _fail(pending.future, WorkerFailed("cancelled", "append cancelled", pending.start_pos))
        for pending in self._computing:
            if pending.seq == seq:
                pending.cancelled = True
        if self._computing and all(p.cancelled for p in self._computing):
            super().set_abort(True)

    def forget_seq(self, seq: int) -> None:
        """The sequence's session is gone: the next batch does not wait for it."""
        self._last_batch_seqs.discard(seq)

    async def _gather(self) -> None:
        """Wait for the last batch's sessions to queue again, up to a quarter of the last batch's compute
        (within [MIN_GATHER_S, MAX_GATHER_S]): a session that misses the batch costs a decode of its own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(self._last_batch_s / 4, MIN_GATHER_S), MAX_GATHER_S)
        while not self._last_batch_seqs <= {pending.seq for pending in self._queue}:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> list[tuple[PendingAppend, BatchItem]]:
        """Queued appends that fit the regions, one per sequence, oldest first. They leave the queue once the
        batch is sealed: an error on the way (the segment released by stop()) leaves them there, to be answered."""
        taken: list[tuple[PendingAppend, BatchItem]] = []
        seqs: set[int] = set()
        input_used = output_used = 0
        width = self.ready.shape.output_width if self.ready else 0
        for pending in list(self._queue):
            input_bytes = pending.rows.nbytes
            if pending.seq in seqs or (taken and input_used + input_bytes > self.input_bytes):
                continue
            if pending.still_wanted is not None:
                try:
                    pending.still_wanted()  # checked as the batch is sealed: the wait for it may have made it stale
                except Exception as refusal:  # noqa: BLE001 - the request's own typed error, answered to it alone
                    self._queue.remove(pending)
                    _fail(pending.future, refusal)
                    continue
            out_rows = self.ready.shape.output_shape(pending.rows.shape[0], pending.output_rows)[0] if self.ready else pending.rows.shape[0]
            out_bytes = out_rows * width * 4
            room = out_bytes if output_used + out_bytes <= self.output_bytes else 0
            view = np.frombuffer(self.segment.buf, pending.rows.dtype, pending.rows.size, self.input_offset + input_used)
            view[:] = pending.rows.reshape(-1)
            taken.append((pending, BatchItem(
                seq=pending.seq, start_pos=pending.start_pos, n_rows=pending.rows.shape[0], input_offset=input_used,
                output_offset=output_used if room else 0, output_capacity=room, output_rows=pending.output_rows, sample=pending.sample,
            )))
            seqs.add(pending.seq)
            input_used += input_bytes
            output_used += room
        for pending, _item in taken:
            self._queue.remove(pending)
        return taken

    async def _run_batches(self) -> None:
        try:
            while self._queue:
                await self._run_batch()
        except Exception as error:  # noqa: BLE001 - a bug must cost these appends an answer, never leave them waiting
            log.error("%s: the batcher failed", self.name, exc_info=True)
            self.lost = True  # what it left on the pipe and in the segment is unknown
            self._fail_held(WorkerLost(f"{self.name}: the batcher failed: {error!r}"))

    async def _run_batch(self) -> None:
        async with self.compute.slot():
            await self._gather()
            batch = self._take_batch()
            if not batch:
                return
            self._computing = [pending for pending, _item in batch]
            self._last_batch_seqs = {pending.seq for pending in self._computing}
            super().set_abort(False)
            started = time.perf_counter()
            try:
                done = await self._expect(RunBatch(items=[item for _pending, item in batch]), BatchDone)
            except (WorkerLost, WorkerFailed) as error:
                for pending, _item in batch:
                    _fail(pending.future, error)
                self._computing = []
                return
            finally:
                super().set_abort(False)
            self._last_batch_s = time.perf_counter() - started
            self.batches += 1
            self.batched_items += len(batch)
            rollbacks = self._answer(batch, done)
            self._computing = []
        await self._roll_back(rollbacks)

    def _answer(self, batch: list[tuple[PendingAppend, BatchItem]], done: BatchDone) -> list[PendingAppend]:
        """Answers the appends that kept their rows or failed; returns the cancelled ones, to roll back."""
        rollbacks = []
        for (pending, _item), result in zip(batch, done.results, strict=True):  # a result an item, or the batcher fails
            if isinstance(result, Failed):
                _fail(pending.future, WorkerFailed(result.code, result.message, result.length))
            elif pending.cancelled or pending.future.done():
                rollbacks.append(pending)
            else:
                pending.future.set_result(self._output_of(result))
        return rollbacks

    async def _roll_back(self, rollbacks: list[PendingAppend]) -> None:
        """Truncates each sequence back to its append's start, then answers each append: cancelled at the
        length the worker truncated to, or the truncate's own failure (answered after the last truncate:
        the module's docstring says why)."""
        answers: dict[PendingAppend, WorkerLost | WorkerFailed] = {}
        try:
            for pending in rollbacks:
                try:
                    truncated = await self._expect(TruncateContext(length=pending.start_pos, seq=pending.seq), Truncated)
                except (WorkerLost, WorkerFailed) as error:
                    answers[pending] = error
                else:
                    answers[pending] = WorkerFailed("cancelled", "append cancelled", truncated.length)
        finally:  # also when an error of another kind ends the batcher: an append left without its truncate is lost with the process
            for pending in rollbacks:
                _fail(pending.future, answers.get(pending) or WorkerLost(f"{self.name}: the rollback of sequence {pending.seq} was not sent"))

    def _output_of(self, appended: Appended) -> WorkerOutput:
        if appended.inline or not appended.rows:
            data = appended.inline
        else:
            start = self.output_offset + appended.output_offset
            data = bytes(self.segment.buf[start : start + appended.rows * appended.width * 4])
        return WorkerOutput(
            length=appended.length, rows=appended.rows, width=appended.width, data=data,
            token=appended.token, top_ids=appended.top_ids, top_logprobs=appended.top_logprobs,
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """As WorkerHandle.stop; appends still waiting are answered WorkerLost. On the batcher's loop: stop may
        run in a thread, and the queue is the loop's (an append queued after that is answered by the batcher,
        which finds the process gone)."""
        if self._batcher is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self._batcher.get_loop().call_soon_threadsafe(self._fail_held, WorkerLost(f"{self.name} stopped"))
        super().stop(timeout_s)

    def _fail_held(self, error: WorkerLost) -> None:
        """Answers every append queued or computing with `error` (on the loop's thread)."""
        for pending in self._queue + self._computing:
            _fail(pending.future, error)
        self._queue, self._computing = [], []


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class SequenceSlot:
    """One sequence of a batched worker, lent by the pool as a worker: the WorkerHandle calls, on its
    sequence only. Its process's life (lost, exited, stopped) is the slot's."""

    restores_with_append = False  # its restore is a command of its own, answered before the batch runs

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

    async def append(
        self, start_pos: int, rows: np.ndarray, output_rows: str = "last", sample: Sampling | None = None, *, bind: Binding | None = None,
        still_wanted: Callable[[], None] | None = None,
    ) -> WorkerOutput:
        if bind is not None:
            raise WorkerFailed("internal", NO_CHANNEL, 0)
        return await self.process.append_seq(self.seq, start_pos, rows, output_rows, sample, still_wanted)

    async def truncate(self, length: int) -> int:
        return (await self.process._expect(TruncateContext(length=length, seq=self.seq), Truncated)).length

    async def close_context(self) -> None:
        self.process.forget_seq(self.seq)
        await self.process._expect(CloseContext(seq=self.seq), Closed)

    async def save_state(self, *, keep: bool = False, head: int = 0, tail: int = 0, owner: int = 0, behind: bool = False) -> Saved:
        # the bytes: a batched worker leaves no room; and saves at its own priority even `behind`: the other sequences'
        # batches wait for the save, so a lower priority would hold them back too
        return await self.process._expect(SaveState(seq=self.seq, keep=keep), Saved)

    async def restore_state(
        self, n_ctx: int, blob: bytes | memoryview | SharedPayload, length: int, owner: int = 0, *, bind: Binding | None = None,
    ) -> Restored:
        if bind is not None:
            raise WorkerFailed("internal", NO_CHANNEL, 0)
        return await self.process._expect(RestoreState(n_ctx=n_ctx, blob=blob, length=length, seq=self.seq), Restored)

    async def revoke_channel(self) -> int:
        raise WorkerFailed("internal", NO_CHANNEL, 0)

    def cancel_direct(self, session_id: str, epoch: int, request_id: int) -> None:
        pass  # no direct channel: nothing is in flight there

    def set_abort(self, value: bool) -> None:
        self.process.cancel_seq(self.seq, value)

"""Admission: a session that becomes hot (a new one, or a parked one restored) gets its whole charge
reserved and a worker before any compute. Room comes from free workers and budget, then from the least
recently used idle hot sessions: parked (their state saved to the spill store) when the warm tier is on,
evicted otherwise; or the request waits up to its admit_timeout_s for room to free up, in line with the
other admissions (kvpool.daemon.admission.queue). Recently used sessions are neither parked nor evicted
(kvpool.daemon.admission.residency)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable

from kvpool.daemon.admission.calibration import Calibrator
from kvpool.daemon.admission.parking import Parking
from kvpool.daemon.admission.queue import AdmissionQueue
from kvpool.daemon.admission.residency import Residency, derived_min_residency_s
from kvpool.daemon.books.books import AdmissionPlan, Books
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.books.spill import CorruptBlob
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.gate import Gate
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.channels import Channels
from kvpool.daemon.pool.handle import WorkerFailed
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.state.shared import SharedPayload, close_payload
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import Append, ErrorCode, MissReason
from workers.server.commands import OPEN_FAILED, RESTORE_FAILED, Binding, Restored

MAX_ADMIT_WAIT_S = 60.0
PARK_RETRY_S = 0.01


class Admission:
    def __init__(
        self, config: ServeConfig, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, calibrator: Calibrator,
        parking: Parking, channels: Channels, gate: Gate, metrics: Metrics,
    ) -> None:
        self.channels = channels
        self.gate = gate
        self.config = config
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.calibrator = calibrator
        self.parking = parking
        self.metrics = metrics
        self.queue = AdmissionQueue(books, pool.usable, lifecycle, metrics, limit=config.admit_queue_limit, residency=self.residency)
        self.refuse_new: Callable[[], None] = lambda: None  # raises once the daemon drains (kvpool.daemon.drain)
        self._residency: Residency | None = None

    def residency(self) -> Residency:
        """--min-residency, or the default derived from the step measured at start-up (fixed once known)."""
        if self._residency is None:
            if self.config.min_residency_s is not None:
                self._residency = Residency(self.config.min_residency_s)
            elif self.calibrator.step_s is not None:
                self._residency = Residency(derived_min_residency_s(self.calibrator.step_s, self.calibrator.shard.shape))
            else:
                return Residency(derived_min_residency_s(None, self.calibrator.shard.shape))  # before start-up calibration
            self.metrics.note("min_residency_ms", round(self._residency.min_s * 1000))
        return self._residency

    def charge_for(self, n_ctx: int) -> int:
        charge = self.calibrator.charge_for(n_ctx)  # fitted at start-up: an admission never measures
        if charge > self.books.budget.limit:
            self.metrics.count("over_budget_rejects")
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"a context of n_ctx {n_ctx} needs {charge} bytes, the budget is {self.books.budget.limit}")
        return charge

    @staticmethod
    def deadline_of(admit_timeout_s: float) -> float:
        return time.monotonic() + min(admit_timeout_s, MAX_ADMIT_WAIT_S)  # checked >= 0 with the request (kvpool.wire.checks.check_admit_timeout)

    async def make_room(self, charge: int, n_ctx: int, deadline: float, *, still_wanted=lambda: None) -> AdmissionPlan:
        """A plan that places `charge` bytes on a worker for a context of `n_ctx` positions, taken in turn (kvpool.daemon.admission.queue: over_budget
        with retry_after_s past the deadline). With the warm tier on, victims are parked one at a time (each
        a save and a context freed) until a plan needs none, the turn kept meanwhile; with it off, the victims bound
        to their direct channels are revoked first (the worker told, as the park's save tells it), then the plan is
        made again: an evicted session is never served after the books let it go, on a worker the plan may hand
        straight to the new session with no command sent yet (its context replaced by that session's first run,
        which may never come: an append refused after its admission). `still_wanted` raises when the request no
        longer makes sense (it is checked after every wait)."""

        def before_each_try() -> None:
            self.refuse_new()
            still_wanted()
            if any(not self.pool.usable(worker) for worker in self.books.free_workers()):
                self.lifecycle.spawn(self.lifecycle.replace_dead_free())
            self.channels.refresh()  # direct appends count as uses: the least recently used is chosen right, residency too

        async with self.queue.turn(deadline) as ticket:
            while True:
                plan = await self.queue.plan(ticket, charge, n_ctx, before_each_try)
                if plan.victims and self.books.spill.enabled:
                    if not await self.parking.park(plan.victims[0]):
                        await asyncio.sleep(PARK_RETRY_S)  # the victim got busy (or is being dropped): plan again
                    continue
                if bound := [victim for victim in plan.victims if victim.channel]:
                    for victim in bound:
                        with contextlib.suppress(RequestFailed):  # its worker lost on the way: the session ended with it
                            await self.channels.revoke(victim)
                    continue
                return plan

    def carry_out(self, plan: AdmissionPlan, evicted_workers: list[str]) -> None:
        """Free the contexts of the evicted sessions' workers and of the spares taken for room."""
        if plan.victims:
            self.metrics.count("evictions", len(plan.victims))
        if plan.spares:
            self.metrics.count("spares_freed", len(plan.spares))
        for worker in evicted_workers:
            self.lifecycle.spawn(self.lifecycle.free(worker))

    async def admit(self, request: Append) -> Session:
        """The new session, its context open, returned with its lock held and one request in flight
        (the admitting append's): nothing can come between admission and that append."""
        n_ctx = request.n_ctx or self.config.n_ctx
        charge = self.charge_for(n_ctx)

        def not_admitted_meanwhile() -> None:
            self.gate.require_current(request.session_id, request.epoch)  # a higher epoch seen while this waited
            live = self.books.table.get(request.session_id)
            if live is not None:
                length = live.length if live.epoch == request.epoch else 0
                raise RequestFailed(ErrorCode.POSITION_MISMATCH, "the session was admitted by a concurrent request", length=length)

        plan = await self.make_room(charge, n_ctx, self.deadline_of(request.admit_timeout_s), still_wanted=not_admitted_meanwhile)
        not_admitted_meanwhile()  # the books change below in this same step: nothing can come between
        session, evicted_workers = self.books.admit(
            plan, session_id=request.session_id, epoch=request.epoch, n_ctx=n_ctx, charge=charge, now=time.monotonic()
        )
        self.carry_out(plan, evicted_workers)
        session.in_flight += 1
        await session.lock.acquire()  # a new session: uncontended
        try:
            async with self.lifecycle.worker_call(session, lost="lost while creating the context", refused=functools.partial(self.open_refused, session)):
                await self.pool.get(session.worker_name).open(n_ctx)
        except RequestFailed:
            self._abandon(session)
            raise
        self.metrics.count("admissions")
        return session

    async def restore(self, session: Session, deadline: float) -> float | None:
        """Make a parked session hot again, its lock held by the caller: a worker and the charge, a fresh
        context loaded with the saved state. A blob that fails its check or that llama.cpp refuses ends
        the session alone (cache_miss, restore_failed); that context is freed, never reused. A process-mode
        worker gets the restore with the append that follows (WorkerHandle.restore_with_append: one round
        trip): then the seconds it took here are returned, for `restored` once that append's reply says how it
        went (its refusal: restore_refused), else None (done here)."""
        started = time.monotonic()
        blob = await self._unpark(session, deadline)
        worker = self.pool.get(session.worker_name)
        if worker.restores_with_append:
            try:
                worker.restore_with_append(session.n_ctx, blob, session.length, owner=session.park_token)
            finally:
                self._close_soon(blob)
            return time.monotonic() - started
        await self._restore_in_worker(session, blob, started, None)
        return None

    async def restore_now(self, session: Session, deadline: float, *, bind: bool) -> str:
        """restore(), done now in the worker whatever its kind (kvpool.wire.protocol.Restore: no append follows
        in this request); with `bind` the restore binds the session to the worker's direct channel as it
        succeeds (RestoreState.bind, one round trip) where the daemon has them: its name is returned ("": none)."""
        started = time.monotonic()
        blob = await self._unpark(session, deadline)
        binding = self.channels.binding(session) if bind else None
        await self._restore_in_worker(session, blob, started, binding)
        return self.channels.bound(session) if binding is not None else ""

    async def _unpark(self, session: Session, deadline: float) -> memoryview | SharedPayload:
        """The session's blob out of the store and the session hot in the books on a worker with its charge
        (room made as an admission's); a damaged blob ends the session (cache_miss)."""
        charge = self.charge_for(session.n_ctx)
        try:
            blob = self.books.take_blob(session)
        except CorruptBlob as error:
            raise self._restore_failed(session, error, MissReason.IDENTITY_MISMATCH if error.mismatch else MissReason.RESTORE_FAILED) from None

        def still_parked() -> None:
            self.gate.check_live(session)

        try:
            plan = await self.make_room(charge, session.n_ctx, deadline, still_wanted=still_parked)
        except BaseException as error:  # a cancelled request too: the blob never stays out of the store
            if self.books.table.get(session.session_id) is session:
                self.metrics.count("spill_drops", len(self.books.put_back_blob(session, blob)))
                if isinstance(error, RequestFailed):
                    error.length = session.length  # over_budget, draining: about this session, still parked at its length
            else:
                close_payload(blob)
            raise
        evicted_workers = self.books.unpark(plan, session, charge)
        self.carry_out(plan, evicted_workers)
        return blob

    async def _restore_in_worker(self, session: Session, blob: memoryview | SharedPayload, started: float, binding: Binding | None) -> None:
        """The worker's restore of `blob` (and the channel bound with it); its reply counted by `restored`."""
        refused = functools.partial(self._restore_failed, session)
        try:
            async with self.lifecycle.worker_call(session, lost="lost while restoring the session", refused=refused):
                restored = await self.pool.get(session.worker_name).restore_state(
                    session.n_ctx, blob, session.length, owner=session.park_token, bind=binding,
                )
        finally:
            self._close_soon(blob)
        self.restored(restored, time.monotonic() - started)

    @staticmethod
    def _close_soon(blob: memoryview | SharedPayload) -> None:
        """Restored or not, the state is no longer the store's: its memory is freed (0.3 ms at 3.76 MiB) once the
        loop next waits, beside the worker's compute of the append that follows (a restore that travels with that
        append holds a descriptor of its own, made before this: workers.server.pipe.prepared_state)."""
        try:
            asyncio.get_running_loop().call_soon(close_payload, blob)
        except RuntimeError:  # no loop runs this (a coroutine closed at shutdown): freed now
            close_payload(blob)

    def restored(self, restored: Restored | None, seconds: float) -> None:
        """A restore done (`restored`: the worker's reply; None if it never said) in `seconds` (a restore that
        travelled with an append: the supervisor's part, to which the worker's own time is added)."""
        if restored is not None and restored.reused:
            self.metrics.count("restores_into_spare")
        if restored is not None and restored.in_place:
            self.metrics.count("restores_in_place")
        self.metrics.observe_restore(seconds)

    def restore_refused(self, session: Session, failure: WorkerFailed) -> RequestFailed | None:
        """A refusal of the append a restore travelled with that is the restore's (its context not created, or
        the state refused): the session ends alone as restore's own refusal ends it; None for the append's own."""
        if failure.code not in (OPEN_FAILED, RESTORE_FAILED):
            return None
        return self._restore_failed(session, failure)

    def open_refused(self, session: Session, failure: WorkerFailed) -> RequestFailed:
        """The context could not be created: the session is forgotten, its worker freed."""
        self._free_later(self.books.forget(session, MissReason.UNKNOWN))
        return RequestFailed(ErrorCode.OVER_BUDGET, f"could not create the context: {failure}")

    def _restore_failed(self, session: Session, why: object, reason: MissReason = MissReason.RESTORE_FAILED) -> RequestFailed:
        """The session ends alone (restore_failed, or identity_mismatch for a state another daemon saved);
        its worker, which may hold the refused context, is freed."""
        self._free_later(self.books.forget(session, reason))
        self.metrics.count("restore_failures")
        self.metrics.count_miss(reason)
        return RequestFailed(ErrorCode.CACHE_MISS, f"the session's saved state could not be restored: {why}", reason=reason)

    def _free_later(self, worker: str | None) -> None:
        if worker is not None:
            self.lifecycle.spawn(self.lifecycle.free(worker))

    @staticmethod
    def _abandon(session: Session) -> None:
        session.lock.release()
        session.in_flight -= 1

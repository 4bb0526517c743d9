"""Admission: a new session gets its whole charge reserved and a worker with a fresh context before any
compute, evicting least recently used idle sessions if that makes room, or waiting up to the request's
admit_timeout_s for room to free up, in line with the other admissions (kvpool.admission_queue); recently
used sessions are not evicted (kvpool.residency)."""

from __future__ import annotations

import time

from kvpool.admission_queue import MAX_ADMIT_WAIT_S, AdmissionQueue
from kvpool.books import Books
from kvpool.calibration import Calibrator
from kvpool.config import ServeConfig
from kvpool.errors import RequestFailed
from kvpool.metrics import Metrics
from kvpool.pool import WorkerPool
from kvpool.protocol import Append, ErrorCode, MissReason
from kvpool.residency import Residency, derived_min_residency_s
from kvpool.sessions import Session
from kvpool.worker_handle import WorkerFailed, WorkerLost
from kvpool.worker_lifecycle import WorkerLifecycle

__all__ = ["MAX_ADMIT_WAIT_S", "Admission"]


class Admission:
    def __init__(self, config: ServeConfig, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, calibrator: Calibrator, metrics: Metrics) -> None:
        self.config = config
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.calibrator = calibrator
        self.metrics = metrics
        self.queue = AdmissionQueue(books, pool.usable, lifecycle, metrics, limit=config.admit_queue_limit, residency=self.residency)
        self._residency: Residency | None = None

    def residency(self) -> Residency:
        """--min-residency, or the default derived from the step measured at start-up (fixed once known)."""
        if self._residency is None:
            if self.config.min_residency_s is not None:
                self._residency = Residency(self.config.min_residency_s)
            elif self.calibrator.step_s is not None:
                self._residency = Residency(derived_min_residency_s(self.calibrator.step_s, self.calibrator.shard))
            else:
                return Residency(derived_min_residency_s(None, self.calibrator.shard))  # before start-up calibration
            self.metrics.note("min_residency_ms", round(self._residency.min_s * 1000))
        return self._residency

    async def admit(self, request: Append) -> Session:
        """The new session, its context open, returned with its lock held and one request in flight
        (the admitting append's): nothing can come between admission and that append."""
        n_ctx = request.n_ctx or self.config.n_ctx
        charge = await self.calibrator.charge_for(n_ctx)
        if charge > self.books.budget.limit:
            self.metrics.count("over_budget_rejects")
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"a context of n_ctx {n_ctx} needs {charge} bytes, the budget is {self.books.budget.limit}")

        def before_each_try() -> None:
            live = self.books.table.get(request.session_id)
            if live is not None:
                length = live.length if live.epoch == request.epoch else 0
                raise RequestFailed(ErrorCode.POSITION_MISMATCH, "the session was admitted by a concurrent request", length=length)
            if any(not self.pool.usable(worker) for worker in self.books.free_workers()):
                self.lifecycle.spawn(self.lifecycle.replace_dead_free())

        async with self.queue.turn(request.admit_timeout_s) as ticket:
            plan = await self.queue.plan(ticket, charge, before_each_try)
            session, evicted_workers = self.books.admit(
                plan, session_id=request.session_id, epoch=request.epoch, n_ctx=n_ctx, charge=charge, now=time.monotonic()
            )
        if plan.victims:
            self.metrics.count("evictions", len(plan.victims))
        for worker in evicted_workers:
            self.lifecycle.spawn(self.lifecycle.free(worker))
        session.in_flight += 1
        await session.lock.acquire()  # a new session: uncontended
        try:
            await self.pool.get(session.worker_name).open(n_ctx)
        except WorkerLost as lost:
            self._abandon(session)
            self.lifecycle.lost(session)
            raise RequestFailed(ErrorCode.WORKER_LOST, f"lost while creating the context: {lost}") from None
        except WorkerFailed as failure:
            self._abandon(session)
            self.lifecycle.spawn(self.lifecycle.free(self.books.forget(session, MissReason.UNKNOWN)))
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"could not create the context: {failure}") from None
        self.metrics.count("admissions")
        return session

    @staticmethod
    def _abandon(session: Session) -> None:
        session.lock.release()
        session.in_flight -= 1

"""Admission: a new session gets its whole charge reserved and a worker with a fresh context before any
compute, evicting least recently used idle sessions if that makes room, or waiting up to the request's
admit_timeout_s for room to free up."""

from __future__ import annotations

import time

from kvpool.books import Books
from kvpool.calibration import Calibrator
from kvpool.config import ServeConfig
from kvpool.errors import RequestFailed
from kvpool.metrics import Metrics
from kvpool.pool import WorkerPool
from kvpool.protocol import Append, ErrorCode, MissReason
from kvpool.sessions import Session
from kvpool.worker_handle import WorkerFailed, WorkerLost
from kvpool.worker_lifecycle import WorkerLifecycle

MAX_ADMIT_WAIT_S = 60.0


class Admission:
    def __init__(self, config: ServeConfig, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, calibrator: Calibrator, metrics: Metrics) -> None:
        self.config = config
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.calibrator = calibrator
        self.metrics = metrics

    async def admit(self, request: Append) -> Session:
        """The new session, its context open, returned with its lock held and one request in flight
        (the admitting append's): nothing can come between admission and that append."""
        n_ctx = request.n_ctx or self.config.n_ctx
        charge = await self.calibrator.charge_for(n_ctx)
        if charge > self.books.budget.limit:
            self.metrics.count("over_budget_rejects")
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"a context of n_ctx {n_ctx} needs {charge} bytes, the budget is {self.books.budget.limit}")
        deadline = time.monotonic() + min(max(request.admit_timeout_s, 0.0), MAX_ADMIT_WAIT_S)
        while True:
            live = self.books.table.get(request.session_id)
            if live is not None:
                length = live.length if live.epoch == request.epoch else 0
                raise RequestFailed(ErrorCode.POSITION_MISMATCH, "the session was admitted by a concurrent request", length=length)
            if any(not self.pool.usable(worker) for worker in self.books.free_workers()):
                self.lifecycle.spawn(self.lifecycle.replace_dead_free())
            plan = self.books.plan_admission(charge, self.pool.usable)
            if plan is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.count("over_budget_rejects")
                raise RequestFailed(
                    ErrorCode.OVER_BUDGET,
                    f"needs {charge} bytes and a worker; {self.books.budget.available} bytes and "
                    f"{sum(map(self.pool.usable, self.books.free_workers()))} workers free, no idle session to evict",
                )
            await self.lifecycle.wait_for_capacity(remaining)
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

"""Housekeeping, run periodically by the supervisor: idle sessions past the TTL expire (in any tier), hot
sessions idle past --park-after are parked, hot sessions idle past --persist-after are copied to disk, free workers that died are replaced, and workers whose measured memory drifted above their charge are recycled when idle."""

from __future__ import annotations

import time

from kvpool.daemon.admission.parking import Parking
from kvpool.daemon.books.books import Books
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.channels import Channels
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.wire.protocol import MissReason


class Housekeeper:
    def __init__(
        self, config: ServeConfig, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, parking: Parking, channels: Channels, metrics: Metrics
    ) -> None:
        self.config = config
        self.channels = channels
        self.parking = parking
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.metrics = metrics

    async def expire_idle(self) -> None:
        self.channels.refresh()  # direct appends count as uses
        for session in self.books.table.expired(time.monotonic(), self.config.ttl_s):
            if session.idle and not session.lock.locked() and self.books.table.get(session.session_id) is session:
                self.metrics.count("expirations")
                await self.lifecycle.drop(session, MissReason.EXPIRED)

    async def free_idle_spares(self) -> None:
        """Free the spare contexts no admission took within --ttl (a park's, a release's): an idle daemon gives
        their memory back, as it does an idle session's."""
        for worker in self.books.idle_spares(time.monotonic(), self.config.ttl_s):
            if self.books.take(lambda _name: True, worker) is not None:  # its spare leaves the books and the budget
                self.metrics.count("spares_expired")
                await self.lifecycle.free(worker)

    async def park_idle(self) -> None:
        """Park hot sessions idle for --park-after seconds (when set and the warm tier is on)."""
        if not self.config.park_after_s or not self.books.spill.enabled:
            return
        self.channels.refresh()
        for session in self.books.table.expired(time.monotonic(), self.config.park_after_s):
            if session.hot and await self.parking.park(session, keep=False, behind=True):  # idle: its memory goes back; nobody waits for the save
                self.metrics.count("parks")

    async def persist_idle(self) -> None:
        """Write behind a copy of every hot session idle for --persist-after seconds whose length changed
        since its last copy (with --spill-dir)."""
        if self.config.persist_after_s is None or self.config.spill_dir is None:
            return
        self.channels.refresh()
        for session in self.books.table.expired(time.monotonic(), self.config.persist_after_s):
            if session.hot:
                await self.parking.persist(session)

    async def kill_stalled_direct(self) -> None:
        """A worker serving a direct channel that has not answered for --request-timeout (computing one
        append, or stopped) is killed, as a supervisor call would have been: its session is worker_lost,
        and the client's channel ends (the client then asks the daemon)."""
        now = time.monotonic()
        for session in self.books.table.sessions():
            if not (session.channel and session.hot) or session.lock.locked():
                continue  # a supervisor call in flight has its own timeout
            worker = self.pool.get(session.worker_name)
            if worker.direct.stalled_for(worker.pid, now) > self.config.request_timeout_s:
                worker.lost = True
                worker.process.kill()
                self.lifecycle.lost(session)

    async def replace_dead_free_workers(self) -> None:
        await self.lifecycle.replace_dead_free()

    async def recycle_drifted(self) -> None:
        """Recycle workers whose measured memory exceeds their charge by more than the margin, when idle.
        Not in batched mode: a batched process's memory is its one context, allocated whole at start."""
        if self.pool.batched:
            return
        margin = self.config.memory_margin_bytes
        for worker in self.pool.workers():
            session = self.books.session_of(worker.name)
            if session is not None and not session.idle:
                continue
            spare = self.books.spare_of(worker.name)
            uss = await self.lifecycle.in_thread(worker.measure_uss)
            if self.books.session_of(worker.name) is not session or self.books.spare_of(worker.name) != spare:
                continue  # taken, freed or given a spare while it was measured: the reading is of another state
            if session is None and uss:
                worker.baseline_uss = min(worker.baseline_uss, uss)  # the baseline is taken while import pages settle
            drift = uss - worker.baseline_uss
            allowed = (session.charged_bytes if session is not None else spare.charge if spare is not None else 0) + margin
            if drift <= allowed:
                continue
            if session is not None:
                if not session.idle or self.books.session_of(worker.name) is not session:
                    continue
                self.books.forget(session, MissReason.EVICTED)
                self.metrics.count("evictions")
            elif self.books.take(lambda _name: True, worker.name) is None:
                continue  # no longer free: taken since the reading
            await self.lifecycle.replace(worker.name)

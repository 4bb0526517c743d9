"""Parking: an idle hot session's state is saved by its worker into the spill store and its charge goes back
to the hot budget; the context is freed, or (process mode) kept by the worker as its spare (kvpool.daemon.
books.books: charged, the first room an admission takes), so that the session's restore or the next
admission of that n_ctx creates no context, and that restore, while the spare is unzeroed, loads nothing. Used for eviction (the warm tier on), for sessions idle
past --park-after, and for the Park request."""

from __future__ import annotations

import itertools

from kvpool.daemon.books.books import Books
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.channels import Channels
from kvpool.daemon.pool.handle import WorkerFailed, WorkerLost
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.state.shared import SharedState
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import ErrorCode, MissReason


class Parking:
    def __init__(self, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, channels: Channels, metrics: Metrics) -> None:
        self.books = books
        self.channels = channels
        self.pool = pool
        self.lifecycle = lifecycle
        self.metrics = metrics
        self._tokens = itertools.count(1)

    def _new_token(self, session: Session) -> int:
        """A token for this park alone: the worker takes the spare it leaves unzeroed only for a restore that
        names it (a session that ends and starts again under the same key gets another)."""
        session.park_token = next(self._tokens)
        return session.park_token

    async def park(self, session: Session, *, entered: bool = False, keep: bool = True, behind: bool = False) -> bool:
        """Park `session` if it is (still) a live, idle hot session; True if its place was freed (parked,
        or lost on the way). With `entered` the caller (a Park request) holds the session's lock and counts
        its request, and a worker lost on the way raises RequestFailed(worker_lost): the request's answer.
        `keep`: the worker keeps the context as its spare (process mode; for a Park request and for room,
        where a restore or an admission is to take it), else frees it (--park-after, a drain: the memory
        goes back). `behind`: no caller waits for the save (a Park answered before it, --park-after): the worker saves at
        a lower CPU priority (workers.server.background)."""
        if not entered:
            if not session.idle or session.lock.locked() or not self._live_hot(session):
                return False
            session.in_flight += 1
            await session.lock.acquire()
        try:
            if not self._live_hot(session):
                return False
            try:
                # the SaveState revokes the direct channel in the worker, as every command does: no round trip of
                # its own unless a direct append computes now; the length is then the one the state is saved at
                await self.channels.revoke(session, by_run=True)
            except RequestFailed:
                if entered:
                    raise
                return True  # its worker was lost on the way: the place is free
            keep = keep and not self.pool.batched  # a batched worker's sequence is emptied where it is
            head, tail = self.books.sealing.room(session)
            self.channels.handed_to_run(session)
            try:
                saved = await self.pool.get(session.worker_name).save_state(keep=keep, head=head, tail=tail, owner=self._new_token(session), behind=behind)
            except WorkerLost as lost:
                self.lifecycle.lost(session)
                if entered:
                    raise RequestFailed(ErrorCode.WORKER_LOST, f"the worker was lost while saving the session's state: {lost}") from None
                return True
            except WorkerFailed:
                await self.lifecycle.drop(session, MissReason.EVICTED)
                self.metrics.count("evictions")
                return True
            blob = saved.blob
            session.length = length = saved.length
            # the prefix store's copy taken first: a shared state that fits nowhere is freed by the park
            offer = bytes(blob.payload if isinstance(blob, SharedState) else blob) if self.books.prefix_wanted(session) else None
            worker, dropped = self.books.park(session, blob, kept=keep)
            if offer is not None and self.books.offer_prefix(session, offer, length) == "stored":
                self.metrics.count("prefix_stored")
            self.metrics.count("spills")
            self.metrics.count("spill_drops", len(dropped))
            if worker is not None:
                await self.lifecycle.free(worker)
            else:
                await self.lifecycle.notify_capacity()
            return True
        finally:
            if not entered:
                session.lock.release()
                session.in_flight -= 1

    async def persist(self, session: Session) -> bool:
        """Write a copy of an idle hot session's state behind to the disk tier (it stays hot): a crash of the
        daemon then costs the router only the tokens appended since. True when a copy was written."""
        if not session.idle or session.lock.locked() or not self._live_hot(session) or session.persisted_length == session.length:
            return False
        session.in_flight += 1
        async with session.lock:
            try:
                if not self._live_hot(session) or session.persisted_length == session.length:
                    return False
                # the save revokes the session's direct channel in the worker, as every command does; it is bound
                # again right after, so that the client's next append still goes straight to the worker
                rebind = self.channels.binding(session) if session.channel else None
                self.channels.handed_to_run(session)
                try:
                    saved = await self.pool.get(session.worker_name).save_state(behind=True)  # a copy nobody waits for
                    # not for an epoch superseded meanwhile (its fence waits for this lock, and revoked nothing yet)
                    if rebind is not None and self._live_current(session) and await self.channels.bind_again(session, rebind):
                        self.channels.bound(session)
                        if not self._live_current(session):  # superseded during the bind: revoked before the lock goes, no copy
                            session.channel = False
                            session.length = await self.pool.get(session.worker_name).revoke_channel()
                            return False
                except WorkerLost:
                    self.lifecycle.lost(session)
                    return False
                except WorkerFailed:
                    self.metrics.count("persist_failures")
                    return False
                if not self._live_hot(session):
                    return False
                session.length = length = saved.length  # the worker's: a direct append that reached it first is in the copy
                if not self.books.spill.write_behind(session.key, self.books.sealing.seal(session, saved.blob)):
                    self.metrics.count("persist_failures")
                    return False
                session.persisted_length = length
                self.metrics.count("persisted")
                return True
            finally:
                session.in_flight -= 1

    def _live_hot(self, session: Session) -> bool:
        return session.hot and self.books.table.get(session.session_id) is session

    def _live_current(self, session: Session) -> bool:
        """Live, hot and at the highest epoch seen for its id (kvpool.daemon.gate's rule)."""
        return self._live_hot(session) and self.books.table.is_current(session.session_id, session.epoch)

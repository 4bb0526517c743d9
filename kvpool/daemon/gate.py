"""The gate every session request passes: epoch fencing, entering a session (its lock, its request count,
its direct channel revoked) and the check, after every await, that what the request is about to create,
serve or expose is still the live session at the highest epoch seen for its id.

The rule it keeps (README, "The contract"): once epoch e is seen for a session id, nothing of an epoch
below e is created, served or exposed. A request waits (for admission, a lock, a worker); while it waits,
another request may see a higher epoch. So a request checks again after each wait, not only on arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from kvpool.daemon.books.books import Books
from kvpool.daemon.books.sessions import EpochCheck, Session
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.channels import Channels
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import ErrorCode, MissReason

ENDED_WHILE_WAITING = "the session ended while this request waited"


class Gate:
    def __init__(
        self, books: Books, channels: Channels, lifecycle: WorkerLifecycle, metrics: Metrics, *, on_leave: Callable[[], None] | None = None,
    ) -> None:
        """`on_leave`: called as every session request leaves (the daemon's --keep-warm stamp)."""
        self.books = books
        self.on_leave = on_leave or (lambda: None)
        self.channels = channels
        self.lifecycle = lifecycle
        self.metrics = metrics
        self._passed_on: set[Session] = set()  # held by a request whose entry passes to work after its reply (pass_on)
        self._fencing: dict[str, asyncio.Future[None]] = {}  # ids whose older epoch a newer one's fence is ending now

    def length_of(self, session_id: str, epoch: int) -> int:
        """The session's length as every reply carries it (0 when no live session of that epoch)."""
        session = self.books.table.get(session_id)
        if session is None or session.epoch != epoch:
            return 0
        self.channels.refresh(session)
        return session.length

    # ---- fencing -----------------------------------------------------------------------------------

    def stale(self, session_id: str, epoch: int) -> RequestFailed:
        table = self.books.table
        self.metrics.count("stale_epoch_rejects")
        highest = table.highest_epoch(session_id)
        if highest is None:  # forgotten, or never seen: the floor fences it (sessions.EpochMemory)
            return RequestFailed(
                ErrorCode.STALE_EPOCH, f"epoch {epoch} is below this daemon's epoch floor {table.epoch_floor}: "
                f"start new sessions at epoch >= {table.epoch_floor}", epoch_floor=table.epoch_floor,
            )
        return RequestFailed(ErrorCode.STALE_EPOCH, f"epoch {epoch} is older than {highest}")

    def require_current(self, session_id: str, epoch: int) -> None:
        """Raise stale_epoch unless `epoch` is (still) the highest seen for the id."""
        if not self.books.table.is_current(session_id, epoch):
            raise self.stale(session_id, epoch)

    async def fence(self, session_id: str, epoch: int) -> None:
        """On arrival: reject a stale epoch; on a newer one, release the old epoch's state first. A request of the
        newer epoch arriving while that release is under way (its worker keeping the context) waits for it: it
        would find the old epoch still in the table (an append at 0 answered cache_miss new_epoch, a release
        releasing what the fence is already ending). Whichever request finds an older epoch still live once no
        release of it is under way (the one that began it failed) releases it itself."""
        table = self.books.table
        check = table.check_epoch(session_id, epoch)
        if check is EpochCheck.STALE:
            raise self.stale(session_id, epoch)
        table.see_epoch(session_id, epoch)
        if check is EpochCheck.NEWER:
            table.note_new_epoch(session_id, epoch)
        elif (ending := self._fencing.get(session_id)) is not None:
            await asyncio.shield(ending)
            self.require_current(session_id, epoch)  # a still newer epoch may have come meanwhile
        old = table.get(session_id)
        if old is None or old.epoch >= epoch:
            return
        ending = self._fencing[session_id] = asyncio.get_running_loop().create_future()
        try:
            # Its direct channel closes now, not once the lock is free: a request holding the lock may
            # wait (for a compute slot) with the channel still bound, and the old epoch would be served there.
            with contextlib.suppress(RequestFailed):  # its worker lost on the way: the session ended with it
                await self.channels.revoke(old)
            async with old.lock:
                if table.get(session_id) is old:
                    await self.lifecycle.drop(old, MissReason.NEW_EPOCH, keep=True)
        finally:
            ending.set_result(None)
            if self._fencing.get(session_id) is ending:
                del self._fencing[session_id]

    def miss(self, session_id: str, epoch: int, message: str) -> RequestFailed:
        reason = self.books.table.miss_reason(session_id, epoch)
        self.metrics.count_miss(reason)
        return RequestFailed(ErrorCode.CACHE_MISS, message, reason=reason)

    def check_live(self, session: Session, what: str = ENDED_WHILE_WAITING, *, current: bool = True) -> None:
        """The session is still the live one for its id, at the highest epoch seen (else: cache_miss or
        stale_epoch). Called after every wait, before the session's state is touched or shown. Without `current`
        a superseded epoch passes while it is live (its fence waits for the lock): what only reads its state into
        the daemon's own store (a prefix capture) may go on, what serves or exposes it may not."""
        if self.books.table.get(session.session_id) is not session:
            raise self.miss(session.session_id, session.epoch, what)
        if current:
            self.require_current(session.session_id, session.epoch)

    # ---- entering a session ------------------------------------------------------------------------

    async def enter(self, session: Session, *, revoke_by_run: bool = False) -> None:
        """Count a request in flight on the session, take its lock (released by leave) and revoke its
        direct channel: from here the supervisor alone changes the session. With `revoke_by_run` (an
        append) the run the request sends revokes it (Channels.revoke)."""
        session.in_flight += 1
        await session.lock.acquire()
        try:
            await self.channels.revoke(session, by_run=revoke_by_run)
        except BaseException:
            session.lock.release()
            session.in_flight -= 1
            raise

    async def leave(self, session: Session) -> None:
        session.lock.release()
        session.in_flight -= 1
        session.passed_on = False  # the lock's holder leaves: what was passed on (pass_on) is done
        session.last_used = time.monotonic()
        self.on_leave()
        if session.in_flight == 0:
            await self.lifecycle.notify_capacity()  # idle now, so evictable: wake admissions waiting for room

    @contextlib.asynccontextmanager
    async def entered(self, session: Session, what: str = ENDED_WHILE_WAITING) -> AsyncIterator[Session]:
        """`async with gate.entered(session):` the session entered and checked live and current, left after."""
        await self.enter(session)
        try:
            self.check_live(session, what)
            yield session
        finally:
            await self.leave(session)

    @contextlib.asynccontextmanager
    async def holding(self, session: Session, *, current: bool = True) -> AsyncIterator[Session]:
        """A session already entered (an admission returns it so, an append enters with revoke_by_run), checked
        live and current (`current`: as check_live), left after (unless it was passed on: pass_on). An append
        refused before its run revokes the channel then, as entering would have: whatever the outcome, the channel
        is revoked or bound again by this append."""
        try:
            self.check_live(session, current=current)
            yield session
        except Exception:
            if session.channel and self.books.table.get(session.session_id) is session:
                await self.channels.revoke(session)
            raise
        finally:
            if session in self._passed_on:
                self._passed_on.discard(session)
            else:
                await self.leave(session)

    def pass_on(self, session: Session, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Inside `holding(session)`, as the request answers: what it entered (the session's lock, its count in
        flight) passes to `work`, spawned now, which holds the session (`async with gate.holding(session)`) and
        leaves it; the request's own holding leaves nothing. No other request takes the session between that
        answer and that work, which a drain waits for (the count in flight) as for a request. Its users: a park
        answered before its save (kvpool.daemon.warm), a prefill's capture for the prefix store (kvpool.daemon.prefix)."""
        self._passed_on.add(session)
        session.passed_on = True  # until that work leaves: an admission that its end would place waits for it (kvpool.daemon.admission.queue)
        return self.lifecycle.spawn(work)

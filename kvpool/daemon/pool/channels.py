"""Direct channels, the supervisor's side: a hot session whose client asked is bound to its worker's
direct channel, and its appends then skip the supervisor. The supervisor stays the authority: before it
acts on such a session (an append through it, truncate, park, fork, cancel checks) it revokes the channel
through the worker, which finishes a direct append in flight first and reports the length; every other
command to the worker revokes it too (a context freed, replaced or restored never serves a stale binding).
Between its own requests the supervisor reads what the worker's control words say (busy, length, last use)."""

from __future__ import annotations

import time

from kvpool.daemon.books.books import Books
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.pool.lifecycle import WorkerLifecycle

REFUSED = "the worker refused its direct channel"


class Channels:
    def __init__(self, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, *, enabled: bool) -> None:
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.enabled = enabled

    async def bind(self, session: Session) -> str:
        """The session's worker serves its appends directly too; the channel's name ("" when off)."""
        if not self.enabled or not session.hot:
            return ""
        worker = self.pool.get(session.worker_name)
        async with self.lifecycle.worker_call(session, refused=REFUSED):
            await worker.bind_channel(session.session_id, session.epoch)
        session.channel = True
        return worker.direct_address

    async def revoke(self, session: Session) -> None:
        """No direct append after this returns; the session's length and last use are the worker's."""
        if not session.channel:
            return
        session.channel = False
        if not session.hot:
            return
        self._read(session)
        async with self.lifecycle.worker_call(session, refused=REFUSED):
            session.length = await self.pool.get(session.worker_name).revoke_channel()

    def busy(self, session: Session) -> bool:
        """An append from the direct channel computes for this session now."""
        return session.channel and session.hot and self.pool.get(session.worker_name).direct.activity()[0]

    def refresh(self, session: Session | None = None) -> None:
        """Lengths and last uses of the bound sessions (or of `session`) as their workers' control words
        say (for LRU, TTL, status and the length every reply carries)."""
        for each in self.books.table.sessions() if session is None else [session]:
            if each.channel and each.hot:
                self._read(each)

    def counts(self) -> dict[str, int]:
        appends = rows = 0
        for worker in self.pool.processes():  # a batched process's slots share its control words
            done, done_rows = worker.direct.counts()
            appends, rows = appends + done, rows + done_rows
        return {"direct_appends": appends, "direct_append_rows": rows}

    def _read(self, session: Session) -> None:
        busy, length, last_used = self.pool.get(session.worker_name).direct.activity()
        if last_used > session.last_used:  # a direct append of this session ended after the supervisor's last look
            session.length, session.last_used = length, last_used
        if busy:
            session.last_used = time.monotonic()  # computing now: neither least recently used nor idle past a TTL

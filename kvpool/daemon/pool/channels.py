"""Direct channels, the supervisor's side: a hot session whose client asked is bound to its worker's
direct channel, and its appends then skip the supervisor. The supervisor stays the authority: before it
acts on such a session (truncate, park, fork, cancel checks) it revokes the channel through the worker,
which finishes a direct append in flight first and reports the length; every other command to the worker
revokes it too (a context freed, replaced or restored never serves a stale binding), an append's run among
them, which also carries the binding that follows it: one pipe round trip for an append.
Between its own requests the supervisor reads what the worker's control words say (busy, length, last use)."""

from __future__ import annotations

import time

from kvpool.daemon.books.books import Books
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.pool.errors import WorkerFailed
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.daemon.pool.pool import WorkerPool
from workers.server.commands import Binding

REFUSED = "the worker refused its direct channel"


class Channels:
    def __init__(self, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, *, enabled: bool) -> None:
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.enabled = enabled

    def binding(self, session: Session) -> Binding | None:
        """What a command binds the channel to once it succeeds (None: no channel to bind). Asked for before every
        command that binds (an append's run, a restore, a bind after a save or a capture): a direct append the
        control words report from then on is the binding's, whatever the worker served before (another session)."""
        if not (self.enabled and session.hot):
            return None
        session.direct_since = time.monotonic()
        return Binding(session_id=session.session_id, epoch=session.epoch)

    def bound(self, session: Session) -> str:
        """The run bound the session's channel: its name."""
        session.channel = True
        return self.address(session)

    def address(self, session: Session) -> str:
        """The name of the session's worker's direct channel (bound to the session or not)."""
        return self.pool.get(session.worker_name).direct_address

    async def revoke(self, session: Session, *, by_run: bool = False) -> None:
        """No direct append after this returns; the session's length and last use are the worker's.

        With `by_run` the caller's append revokes the channel itself (the worker revokes it on every command,
        before it computes: handed_to_run), one round trip fewer, when no direct append computes now: the
        length is then the last direct append's, read from the control words. One that starts before the
        run reaches the worker comes first, and the worker checks the run's position against what it left."""
        if not session.channel:
            return
        if not session.hot:
            session.channel = False
            return
        computing = self._read(session)
        if by_run and not computing:
            return
        session.channel = False
        async with self.lifecycle.worker_call(session, refused=REFUSED):
            session.length = await self.pool.get(session.worker_name).revoke_channel()

    async def bind_again(self, session: Session, binding: Binding) -> bool:
        """After a command that revoked the channel (a prefix capture's or a copy's save), the worker serves
        `binding` from it again; False when it refuses (the channel stays revoked: the client asks the daemon)."""
        try:
            await self.pool.get(session.worker_name).bind_channel(binding)
        except WorkerFailed:
            return False
        return True

    @staticmethod
    def handed_to_run(session: Session) -> None:
        """The run about to be sent revokes the channel (and binds it again if it carries a Binding)."""
        session.channel = False

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

    def _read(self, session: Session) -> bool:
        """Take what the control words say; whether a direct append computes now (then the length is not final)."""
        busy, length, ended = self.pool.get(session.worker_name).direct.activity()
        if ended > session.direct_since:  # a direct append of this binding ended after the last one taken
            session.length, session.direct_since = length, ended
            session.last_used = max(session.last_used, ended)
        if busy:
            session.last_used = time.monotonic()  # computing now: neither least recently used nor idle past a TTL
        return busy

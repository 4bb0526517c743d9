"""Shared prefixes on one daemon (README, "Shared prefixes"): a lookup of how many leading blocks the prefix
store holds, an admission of a new session from a stored prefix (parked, restored by its next append exactly
as a parked session is), and what keeps the store filled without computing anything twice: the block digests
an append carries are kept with its session, and a session's state is offered to the store once a prefill
completes a block the store does not hold (saved by its worker right after the append's reply: PrefixRequests.
capture_after), when it is parked (kvpool.daemon.admission.parking) and before it is released."""

from __future__ import annotations

import asyncio
import logging
import time

from kvpool.daemon.books.books import Books
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.books.spill import CorruptBlob
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.gate import Gate
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.handle import WorkerFailed, WorkerLost
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.warm import WarmRequests
from kvpool.wire.checks import check_prefix_names, check_session_fields
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import AdmitPrefix, Append, Done, ErrorCode, MissReason, PrefixHeld, PrefixLookup
from workers.server.commands import Binding

log = logging.getLogger("kvpool.daemon")
BIND_REFUSED = "binding the direct channel after the prefix capture failed"


class PrefixRequests:
    def __init__(
        self, config: ServeConfig, books: Books, gate: Gate, warm: WarmRequests, pool: WorkerPool, metrics: Metrics,
    ) -> None:
        self.config = config
        self.books = books
        self.store = books.prefixes
        self.gate = gate
        self.warm = warm
        self.pool = pool
        self.metrics = metrics
        self._capturing: dict[asyncio.Task, bytes] = {}  # captures after an append's reply, not yet offered: their first blocks' digests

    @property
    def block(self) -> int:
        """Tokens per block, as HelloReply.prefix_block says (0: no store)."""
        return self.store.block if self.store.enabled else 0

    def _check(self, scope: str, digests: list[bytes], length: int = 0) -> None:
        if not self.store.enabled:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "this daemon keeps no prefix store (--prefix-cache-budget 0 or --spill-budget 0)", length=length)
        check_prefix_names(scope, digests, self.config.max_prefix_digests, length=length)

    # ---- requests --------------------------------------------------------------------------------

    async def lookup(self, request: PrefixLookup) -> PrefixHeld:
        self._check(request.scope, request.digests)
        if request.digests:
            await self._captured(request.digests[0])
        self.metrics.count("prefix_lookups")
        return PrefixHeld(blocks=self.store.holds(request.scope, request.digests), block=self.store.block)

    async def admit(self, request: AdmitPrefix) -> Done:
        check_session_fields(request.session_id, request.epoch, self.gate.length_of(request.session_id, request.epoch))
        self._check(request.scope, request.digests)
        if not request.digests:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "a prefix admission names at least one block")
        await self._captured(request.digests[0])
        n_ctx = request.n_ctx or self.config.n_ctx
        length = len(request.digests) * self.store.block
        if not 0 < n_ctx <= self.config.n_ctx or length > n_ctx:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"a prefix of {length} positions in n_ctx {n_ctx}: n_ctx must be in [{length}, {self.config.n_ctx}] (0: the default)")
        await self.gate.fence(request.session_id, request.epoch)
        if self.books.table.get(request.session_id) is not None:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"session {request.session_id!r} already holds state at epoch {request.epoch}: release it first")
        session = Session(
            session_id=request.session_id, epoch=request.epoch, n_ctx=n_ctx, charged_bytes=0, worker_name="", length=length,
            last_used=time.monotonic(), digests=list(request.digests), prefix_scope=request.scope,
        )
        with self.store.leased(request.scope, request.digests) as entry:
            if entry is None:
                self.metrics.count("prefix_misses")
                self.metrics.count_miss(MissReason.PREFIX_EVICTED)
                raise RequestFailed(ErrorCode.CACHE_MISS, f"the prefix store no longer holds these {len(request.digests)} blocks", reason=MissReason.PREFIX_EVICTED)
            try:  # written once into a memfd sealed in place as the parked state, whose descriptor the restore sends on
                payload = self.store.read(entry, len(request.digests), room=self.books.sealing.room(session))
            except CorruptBlob as error:
                self.metrics.count("prefix_misses")
                self.metrics.count_miss(MissReason.PREFIX_EVICTED)
                raise RequestFailed(ErrorCode.CACHE_MISS, str(error), reason=MissReason.PREFIX_EVICTED) from None
        self.warm.add_parked(session, payload, "the prefix's state", "the prefix's state")
        self.metrics.count("prefix_hits")
        self.metrics.count("prefix_hit_tokens", length)
        return Done(length=length, session_id=session.session_id, epoch=session.epoch, detail="admitted from a prefix")

    # ---- keeping the store filled ------------------------------------------------------------------

    def _continuing(self, session: Session, request: Append, n_rows: int) -> bool:
        """The append's digests continue the session's: one per block whose end it reaches, from the first
        block the session does not name yet."""
        block = self.store.block
        start = request.start_pos
        return (
            bool(request.block_digests) and self.store.enabled and len(session.digests) == start // block
            and len(request.block_digests) == (start + n_rows) // block - start // block
        )

    def capture_wanted(self, session: Session, request: Append, n_rows: int) -> bool:
        """A prefill (more than one row) completes blocks the store lacks: its state is offered as it ends."""
        if n_rows < 2 or not self._continuing(session, request, n_rows):
            return False
        chain = session.digests + request.block_digests
        return self.store.holds(session.prefix_scope, chain) < len(chain)

    def record(self, session: Session, request: Append, n_rows: int) -> None:
        """An append succeeded: the digests it carries of the blocks it completed join the session's when
        they continue them; otherwise they are ignored."""
        if self._continuing(session, request, n_rows):
            session.digests.extend(request.block_digests)

    def capture_after(self, session: Session, binding: Binding | None) -> None:
        """Offer the state a prefill just left once the append that left it has answered (capture_wanted said so;
        the caller holds the session and its run bound no channel): the append passes the session on to a task
        (Gate.pass_on: no other request takes it between the reply and the save), which saves the state (in process
        mode at the worker's lower priority, --background-nice: no caller waits for it) and offers what the store
        lacks, then, with `binding` (the append asked for the direct channel), binds the channel whose name the
        reply already gave: a direct append sent before that is answered channel_revoked and the client asks the
        daemon, which waits for the capture. A lookup or a prefix admission waits for the captures pending as it
        arrives whose chains begin with its first block (that digest names the scope and the block: no other
        capture can add to what it asks), so an append's blocks are seen by those after its reply. A save that
        fails offers nothing and the append stands; a worker lost meanwhile ends the session (worker_lost next)."""
        task = self.gate.pass_on(session, self._capture(session, binding))
        self._capturing[task] = session.digests[0]
        task.add_done_callback(lambda done: self._capturing.pop(done, None))

    async def _capture(self, session: Session, binding: Binding | None) -> None:
        try:
            # a newer epoch seen since the prefill still lets its blocks be stored (content-addressed: the same
            # tokens' state whatever the epoch), never its channel bound
            async with self.gate.holding(session, current=False), self.gate.lifecycle.worker_call(session, refused=BIND_REFUSED):
                worker = self.pool.get(session.worker_name)
                if self.books.prefix_wanted(session):
                    try:
                        payload = (await worker.save_state(behind=True)).blob
                    except WorkerFailed:
                        payload = None
                    if payload is not None:
                        self.offered(self.books.offer_prefix(session, payload, session.length))
                if binding is not None:
                    self.gate.check_live(session)  # a newer epoch seen during the save: nothing of this one is bound
                    await worker.bind_channel(binding)
                    self.gate.channels.bound(session)
                    self.gate.check_live(session)  # and during the bind: holding revokes what it bound
        except RequestFailed as failure:  # fenced, its worker lost (the session ended with it) or its channel refused
            log.info("prefix capture of session %r epoch %d after its append: %s", session.session_id, session.epoch, failure)

    async def _captured(self, first_block: bytes) -> None:
        """The captures pending now of chains that begin with `first_block` have offered what they took."""
        pending = [task for task, first in self._capturing.items() if first == first_block]
        if pending:
            await asyncio.wait(pending)

    async def before_release(self, session: Session) -> None:
        """The session (its lock held) is about to be released: its blocks the store lacks are offered first,
        from its parked state or saved by its worker."""
        if not self.books.prefix_wanted(session):
            return
        try:
            if session.hot:
                payload = (await self.pool.get(session.worker_name).save_state()).blob
            else:
                payload = self.books.read_blob(session)
        except (WorkerFailed, WorkerLost, CorruptBlob):  # nothing offered: the release frees what is left
            return
        self.offered(self.books.offer_prefix(session, payload, session.length))

    def offered(self, outcome: str) -> None:
        if outcome == "stored":
            self.metrics.count("prefix_stored")

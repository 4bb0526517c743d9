"""Park, Restore and Fork: the requests that move a session's state into the spill store (see kvpool.daemon.admission.parking),
back out of it before its next append, or copy it into a new session. Same fencing and typed errors as every other session
request."""

from __future__ import annotations

import logging
import time

from kvpool.daemon.admission.admission import Admission
from kvpool.daemon.admission.parking import Parking
from kvpool.daemon.books.books import Books
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.books.spill import CorruptBlob
from kvpool.daemon.gate import Gate
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.channels import Channels
from kvpool.daemon.pool.errors import WorkerFailed
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.state.shared import SharedState
from kvpool.wire.checks import check_admit_timeout, check_session_fields
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import Done, ErrorCode, Fork, MissReason, Park, Restore

log = logging.getLogger("kvpool.serve")


class WarmRequests:
    def __init__(
        self, books: Books, gate: Gate, parking: Parking, admission: Admission, channels: Channels, pool: WorkerPool, lifecycle: WorkerLifecycle,
        metrics: Metrics,
    ) -> None:
        self.books = books
        self.admission = admission
        self.channels = channels
        self.gate = gate
        self.parking = parking
        self.pool = pool
        self.lifecycle = lifecycle
        self.metrics = metrics

    def require_tier(self, what: str) -> None:
        if not self.books.spill.enabled:
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"{what} needs the warm tier, which is off on this daemon (--spill-budget 0)")

    async def park(self, request: Park) -> Done:
        check_session_fields(request.session_id, request.epoch, self.gate.length_of(request.session_id, request.epoch))
        self.require_tier("park")
        await self.gate.fence(request.session_id, request.epoch)
        session = self.books.table.get(request.session_id)
        if session is None:
            raise self.gate.miss(request.session_id, request.epoch, "no state for this session")
        await self.gate.enter(session, revoke_by_run=True)  # the park's SaveState revokes the direct channel (Parking.park)
        async with self.gate.holding(session):
            if not session.hot:
                return _done(session, "already parked")
            if not request.wait:
                self.gate.pass_on(session, self._finish_park(session))
                return _done(session, "parking")
            if not await self._save(session):
                raise self.gate.miss(session.session_id, session.epoch, "the session's state could not be kept")
            return _done(session, "parked")

    async def _save(self, session: Session, *, behind: bool = False) -> bool:
        """The entered session's park (Parking.park); True if its state is in the store."""
        await self.parking.park(session, entered=True, behind=behind)
        kept = self.books.table.get(session.session_id) is session
        if kept:
            self.metrics.count("parks")
        return kept

    async def _finish_park(self, session: Session) -> None:
        """A park without `wait`, answered "parking": the request passed the session on to this task (Gate.pass_on),
        so none sees the session between that reply and its state in the store, and a drain waits for it; a save that
        fails ends the session as a waiting park's would (its next request: cache_miss), logged here since no reply is
        left to carry it. No caller waits for that save: a single worker runs it at a lower CPU priority
        (SaveState.behind, workers.server.background), so the parks a route's other daemons are answering at the
        same moment take the cores first."""
        try:
            async with self.gate.holding(session):
                if not await self._save(session, behind=True):
                    log.warning("park of session %r epoch %d (answered parking): its state could not be kept; its next request: cache_miss",
                                session.session_id, session.epoch)
        except RequestFailed as failure:  # its worker lost (the session with it), or the session ended or was fenced first
            level = logging.WARNING if failure.code is ErrorCode.WORKER_LOST else logging.INFO
            log.log(level, "park of session %r epoch %d (answered parking) ended without a save: %s", session.session_id, session.epoch, failure)

    async def restore(self, request: Restore) -> Done:
        """A parked session hot again now (Admission.restore_now: what the append that restores it would do, done
        before it, so the restores of a route's daemons overlap), "restored"; a hot one stays hot, "hot". Entering
        the session revokes its direct channel, as every request that enters one does; with `direct` the reply names
        the channel the session is bound to (a hot one's bound again: a second worker round trip)."""
        length = self.gate.length_of(request.session_id, request.epoch)
        check_session_fields(request.session_id, request.epoch, length)
        check_admit_timeout(request.admit_timeout_s, length)
        await self.gate.fence(request.session_id, request.epoch)
        session = self.books.table.get(request.session_id)
        if session is None:
            raise self.gate.miss(request.session_id, request.epoch, "no state for this session")
        await self.gate.enter(session)
        async with self.gate.holding(session):
            if session.hot:
                channel = await self._bound_again(session) if request.direct else ""
                detail = "hot"
            else:
                channel = await self.admission.restore_now(session, self.admission.deadline_of(request.admit_timeout_s), bind=request.direct)
                self.metrics.count("restore_requests")
                detail = "restored"
            self.gate.check_live(session)  # after the worker's answer: a newer epoch seen meanwhile revokes what was bound (holding)
            return _done(session, detail, channel)

    async def _bound_again(self, session: Session) -> str:
        """A hot session's direct channel (entering revoked it) bound again: its name, "" where the daemon has none.
        A refusal is the restore's where it is one (a restore that travelled with a cancelled append, sent first:
        the session ends, cache_miss), else internal."""
        binding = self.channels.binding(session)
        if binding is None:
            return ""

        def refused(failure: WorkerFailed) -> RequestFailed:
            restore = self.admission.restore_refused(session, failure)
            return restore or RequestFailed(ErrorCode.INTERNAL, f"binding the direct channel failed: {failure}", length=session.length)

        async with self.lifecycle.worker_call(session, refused=refused):
            await self.pool.get(session.worker_name).bind_channel(binding)
        return self.channels.bound(session)

    async def fork(self, request: Fork) -> Done:
        check_session_fields(request.session_id, request.epoch, self.gate.length_of(request.session_id, request.epoch))
        check_session_fields(request.new_session_id, request.new_epoch, 0)
        if request.new_session_id == request.session_id:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "a fork needs a new session id")
        if request.length < 0:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "length must be >= 0")
        self.require_tier("fork")
        await self.gate.fence(request.session_id, request.epoch)
        await self.gate.fence(request.new_session_id, request.new_epoch)
        source = self.books.table.get(request.session_id)
        if source is None:
            raise self.gate.miss(request.session_id, request.epoch, "no state for the source session")
        self._refuse_existing(request)
        blob, _ = await self.saved_state(source, request.length)
        self._refuse_existing(request)
        self.gate.require_current(request.session_id, request.epoch)  # nothing of a stale source seeds a fork
        self.gate.require_current(request.new_session_id, request.new_epoch)  # a higher epoch seen while it waited
        fork = Session(
            session_id=request.new_session_id, epoch=request.new_epoch, n_ctx=source.n_ctx, charged_bytes=source.charged_bytes,
            worker_name="", length=request.length, last_used=time.monotonic(),
        )
        self.add_parked(fork, blob, "the source's state", "the fork's state")
        self.metrics.count("forks")
        return Done(length=fork.length, session_id=fork.session_id, epoch=fork.epoch, detail="forked")

    def add_parked(self, session: Session, blob: bytes | SharedState, what: str, kept: str) -> None:
        """A new live session that starts parked on `blob` (its payload; a SharedState's is sealed in place and
        becomes the store's, closed here if refused), or over_budget / cache_miss and nothing added. `what` and
        `kept` name the state in those errors."""
        payload_bytes = blob.payload_bytes if isinstance(blob, SharedState) else len(blob)
        if not self.books.spill.fits(self.books.sealing.size(session, payload_bytes)):
            if isinstance(blob, SharedState):
                blob.close()
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"{what} ({payload_bytes} bytes) does not fit in the spill store")
        dropped = self.books.add_parked(session, blob)
        self.metrics.count("spill_drops", len(dropped))
        if session in dropped:
            raise self.gate.miss(session.session_id, session.epoch, f"{kept} could not be kept")

    def _refuse_existing(self, request: Fork) -> None:
        if self.books.table.get(request.new_session_id) is not None:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"session {request.new_session_id!r} already holds state at epoch {request.new_epoch}: release it first")

    async def saved_state(self, source: Session, length: int | None = None) -> tuple[bytes, int]:
        """The source's saved state (llama.cpp's bytes: positions [0, its length), cut to `length` when
        restored) and the length it holds: a hot source is saved and stays hot, a parked one is read from the
        store. A damaged stored state drops the source (cache_miss restore_failed)."""
        async with self.gate.entered(source, "the source session ended while this request waited"):
            if length is not None and length > source.length:
                raise RequestFailed(ErrorCode.POSITION_MISMATCH, f"cannot fork {length} positions: the source holds {source.length}", length=source.length)
            if not source.hot:
                try:
                    return self.books.read_blob(source), source.length
                except CorruptBlob as error:
                    await self.lifecycle.drop(source, MissReason.RESTORE_FAILED)
                    self.metrics.count("restore_failures")
                    self.metrics.count_miss(MissReason.RESTORE_FAILED)
                    raise RequestFailed(ErrorCode.CACHE_MISS, f"the source's saved state is damaged: {error}", reason=MissReason.RESTORE_FAILED) from None
            async with self.lifecycle.worker_call(source, lost="the worker serving the source session was lost", refused="saving the source's state failed"):
                return (await self.pool.get(source.worker_name).save_state()).blob, source.length


def _done(session: Session, detail: str, channel: str = "") -> Done:
    return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail=detail, channel=channel)

"""Request semantics of one shard daemon: the contract routers rely on (see README, "The contract").

Runs on the supervisor's event loop and composes the parts: the books (sessions, budget, binding), the
worker pool and its lifecycle, calibration, admission, compute slots, housekeeping. Every decision about
sessions is made on the loop between awaits, so the books change atomically.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from kvpool.daemon.admission.admission import Admission
from kvpool.daemon.admission.calibration import Calibrator
from kvpool.daemon.admission.parking import Parking
from kvpool.daemon.books.books import Books
from kvpool.daemon.books.integrity import require
from kvpool.daemon.books.prefixes import SUBDIR as PREFIX_SUBDIR
from kvpool.daemon.books.prefixes import PrefixStore
from kvpool.daemon.books.sessions import EpochCheck, Session
from kvpool.daemon.books.spill import CorruptBlob, SpillStore
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.gate import Gate
from kvpool.daemon.gpu import VramMeter
from kvpool.daemon.housekeeping import Housekeeper
from kvpool.daemon.keep_warm import KeepWarm
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.channels import Channels
from kvpool.daemon.pool.compute import ComputeSlots
from kvpool.daemon.pool.handle import WorkerFailed
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.prefix import PrefixRequests
from kvpool.daemon.status import build_stats, integrity_of
from kvpool.daemon.transfer import Transfers
from kvpool.daemon.warm import WarmRequests
from kvpool.state.header import UNBOUND, StateIdentity
from kvpool.wire.checks import append_rows, check_position, check_prefix_names, check_session_fields
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import (
    AdmitPrefix,
    Append,
    AppendReply,
    Cancel,
    Done,
    ErrorCode,
    Export,
    Exported,
    Fork,
    Import,
    MissReason,
    Park,
    PrefixHeld,
    PrefixLookup,
    Release,
    Restore,
    ShardDescription,
    StatsReply,
    Truncate,
)
from workers.server.commands import OPEN_FAILED


class KvService:
    def __init__(
        self, config: ServeConfig, pool: WorkerPool, shard: ShardDescription, kv_bytes_per_position: int, identity: StateIdentity = UNBOUND,
        *, keep_warm: KeepWarm | None = None,
    ) -> None:
        """`keep_warm`: the daemon's spinners (--keep-warm), told of every session request's end."""
        self.config = config
        self.keep_warm = keep_warm
        self.pool = pool
        self.shard = shard
        self.metrics = Metrics()
        spill = SpillStore(config.spill_limit_bytes, disk_dir=config.spill_dir, disk_limit_bytes=config.spill_disk_budget_bytes)
        prefixes = PrefixStore(
            config.prefix_limit_bytes, config.prefix_block, identity=identity,
            directory=config.spill_dir / PREFIX_SUBDIR if config.spill_dir is not None else None,
        )
        self.books = Books(
            config.budget_bytes, pool.names(), spill=spill, on_change=self.metrics.show_books, fence_ids=config.fence_ids, identity=identity,
            prefixes=prefixes,
        )
        self.metrics.show_books(self.books)
        self.metrics.limit_bytes.set(config.budget_bytes)
        self.vram = VramMeter()
        self.started = time.monotonic()
        self.huge_pages = ""  # --huge-pages and what the first worker's load came to (set by the supervisor)
        self.threads_detail = ""  # a worker's llama threads and how its idle ones spin (set by the supervisor)
        self.mode_reason = ""  # --mode auto: why this mode (set by the supervisor)
        self.compute = ComputeSlots(config.concurrent_workers)
        pool.use_compute_slots(self.compute)  # batched workers take one per batch
        self.lifecycle = WorkerLifecycle(self.books, pool, self.metrics, threads=2 * config.max_sessions + 4)
        self.calibrator = Calibrator(
            self.books, pool, self.lifecycle, self.metrics, shard, kv_bytes_per_position,
            shared_context=pool.shared_context(),
        )
        self.channels = Channels(self.books, pool, self.lifecycle, enabled=config.uses_direct_channels)
        self.parking = Parking(self.books, pool, self.lifecycle, self.channels, self.metrics)
        self.gate = Gate(self.books, self.channels, self.lifecycle, self.metrics, on_leave=keep_warm.touch if keep_warm is not None else None)
        self.admission = Admission(config, self.books, pool, self.lifecycle, self.calibrator, self.parking, self.channels, self.gate, self.metrics)
        self.warm = WarmRequests(self.books, self.gate, self.parking, self.admission, self.channels, pool, self.lifecycle, self.metrics)
        self.transfers = Transfers(config, self.books, self.gate, self.warm, self.metrics)
        self.prefixes = PrefixRequests(config, self.books, self.gate, self.warm, pool, self.metrics)
        self.housekeeper = Housekeeper(config, self.books, pool, self.lifecycle, self.parking, self.channels, self.metrics)

    def _reseal(self, session: Session) -> None:
        """A parked session's stored state says its new length (a daemon adopting the file believes it)."""
        try:
            dropped = self.books.reseal(session)
        except CorruptBlob as error:
            self.books.forget(session, MissReason.RESTORE_FAILED)
            self.metrics.count("restore_failures")
            raise RequestFailed(ErrorCode.CACHE_MISS, f"the session's saved state is damaged: {error}", reason=MissReason.RESTORE_FAILED) from None
        self.metrics.count("spill_drops", len(dropped))
        if session in dropped:
            raise self.gate.miss(session.session_id, session.epoch, "the truncated state could not be kept")

    def adopt_saved_states(self) -> str:
        """The --spill-dir files of an earlier run whose identity is this daemon's become parked sessions;
        every other file of the store's is removed. Returns the one log line that says what happened."""
        found, rejected = self.books.spill.scan(self.books.sealing.identity)
        adopted, left_out = self.books.adopt(found, max_n_ctx=self.config.n_ctx)
        rejected.update(left_out)
        self.metrics.count("adopted", len(adopted))
        removed = ", ".join(f"{count} {reason}" for reason, count in sorted(rejected.items()))
        prefixes = self.books.prefixes.adopt()
        adopted_prefixes = prefixes.pop("adopted", 0)
        self.metrics.count("prefix_adopted", adopted_prefixes)
        self.metrics.show_books(self.books)
        prefixes_removed = ", ".join(f"{count} {reason}" for reason, count in sorted(prefixes.items()))
        return (
            f"adopted {len(adopted)} parked sessions from {self.config.spill_dir}"
            + (f" ({sum(session.length for session in adopted)} positions)" if adopted else "")
            + (f"; not adopted: {removed}" if rejected else "")
            + (f"; {adopted_prefixes} stored prefixes" if adopted_prefixes or prefixes else "")
            + (f" (not adopted: {prefixes_removed})" if prefixes else "")
        )

    def check_integrity(self) -> None:
        self.books.check_integrity()
        self.pool.check_integrity()
        require(self.books.workers() == set(self.pool.names()), "the books' workers != the pool's workers")

    # ---- validation and fencing ------------------------------------------------------------------

    def _validate_append(self, request: Append) -> np.ndarray:
        """The request's rows as the worker takes them: int32 token ids (first shard) or float32 hidden states."""
        length = self.gate.length_of(request.session_id, request.epoch)
        check_session_fields(request.session_id, request.epoch, length)
        if not 0 <= request.n_ctx <= self.config.n_ctx:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"n_ctx must be in [0, {self.config.n_ctx}] (0: the default {self.config.n_ctx})", length=length)
        rows = append_rows(request, self.shard.shape, max_rows=self.config.n_ctx, length=length)
        check_prefix_names(request.prefix_scope, request.block_digests, self.config.max_prefix_digests, length=length)
        return rows

    # ---- requests --------------------------------------------------------------------------------

    async def append(self, request: Append) -> AppendReply:
        rows = self._validate_append(request)
        gate = self.gate
        await gate.fence(request.session_id, request.epoch)
        session = self.books.table.get(request.session_id)
        admitted = session is None
        if session is None:
            if request.start_pos > 0:
                raise gate.miss(request.session_id, request.epoch, f"no state for this session at position {request.start_pos}")
            session = await self.admission.admit(request)  # returned entered: lock held, in flight
            session.prefix_scope = request.prefix_scope
        else:
            self.metrics.count("hits")
            await gate.enter(session, revoke_by_run=True)
        async with gate.holding(session):
            check_position(request.start_pos, session.length, rows.shape[0], session.n_ctx)  # a refused append restores nothing
            restored = not session.hot
            restoring = None
            if restored:
                restoring = await self.admission.restore(session, self.admission.deadline_of(request.admit_timeout_s))
                gate.check_live(session)
            return await self._append_entered(session, request, rows, admitted, restored, restoring)

    async def _append_entered(
        self, session: Session, request: Append, rows: np.ndarray, admitted: bool, restored: bool, restoring: float | None = None,
    ) -> AppendReply:
        """`restoring`: when the restore travels with this append (Admission.restore), the seconds it took the supervisor."""
        n_rows = rows.shape[0]
        check_position(request.start_pos, session.length, n_rows, session.n_ctx)
        worker = self.pool.get(session.worker_name)
        binding = self.channels.binding(session) if request.direct else None
        capture = self.prefixes.capture_wanted(session, request, n_rows)
        worker.set_abort(False)
        session.appending = True
        refused = functools.partial(self._append_refused, session, restoring)
        try:
            async with self.lifecycle.worker_call(session, refused=refused), self.pool.append_slot():
                self.channels.handed_to_run(session)
                output = await worker.append(
                    request.start_pos, rows, str(request.output_rows), request.sample, bind=None if capture else binding,
                    # checked after the wait for a compute slot or a batch; a refusal then leaves no binding behind:
                    # the fence that made it stale revoked the channel, a session that ended freed its context
                    still_wanted=lambda: self.gate.check_live(session),
                )
                session.length = output.length
                if output.reused:
                    self.metrics.count("admissions_into_spare")
                if restoring is not None:
                    self.admission.restored(output.restored, restoring + (output.restored.seconds if output.restored is not None else 0.0))
                self.prefixes.record(session, request, n_rows)
        finally:
            session.appending = False
            worker.set_abort(False)  # a cancel that arrived as the append finished must not outlive it
        self.metrics.count("appends")
        self.metrics.count("append_rows", n_rows)
        if capture:  # saved after this reply, then the channel bound: its name given now
            self.prefixes.capture_after(session, binding)
            channel = self.channels.address(session) if binding is not None else ""
        else:
            channel = self.channels.bound(session) if binding is not None else ""
            if binding is not None:
                # a newer epoch's fence that came during the run revoked nothing (the channel was the run's): holding
                # revokes what the run bound before the lock goes, and the fence then ends the session
                self.gate.check_live(session)
        return AppendReply(
            session_id=session.session_id, epoch=session.epoch, length=session.length,
            rows=output.rows, width=output.width, data=output.data, admitted=admitted, restored=restored,
            token=output.token, top_ids=output.top_ids, top_logprobs=output.top_logprobs, channel=channel,
        )

    def _append_refused(self, session: Session, restoring: float | None, failure: WorkerFailed) -> RequestFailed:
        """The worker's own code (internal where it names none), and the length it rolled back to; a failed
        open (an admission's, which travels with the first run) is the admission's, a refused restore that
        travelled with it the restore's."""
        if restoring is not None:
            if (refusal := self.admission.restore_refused(session, failure)) is not None:
                return refusal
            self.admission.restored(None, restoring)  # restored, then the append failed (cancelled, ...): the worker's part unknown
        if failure.code == OPEN_FAILED:
            return self.admission.open_refused(session, failure)
        session.length = failure.length
        code = ErrorCode(failure.code) if failure.code in set(ErrorCode) else ErrorCode.INTERNAL
        if code is ErrorCode.CANCELLED:
            self.metrics.count("cancels")
        return RequestFailed(code, str(failure), length=session.length)

    async def truncate(self, request: Truncate) -> Done:
        check_session_fields(request.session_id, request.epoch, self.gate.length_of(request.session_id, request.epoch))
        if request.length < 0:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "length must be >= 0", length=self.gate.length_of(request.session_id, request.epoch))
        await self.gate.fence(request.session_id, request.epoch)
        session = self.books.table.get(request.session_id)
        if session is None:
            if request.length == 0:
                return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="no state")
            raise self.gate.miss(request.session_id, request.epoch, "no state for this session")
        async with self.gate.entered(session):
            if request.length > session.length:
                raise RequestFailed(ErrorCode.POSITION_MISMATCH, f"cannot truncate to {request.length}: length is {session.length}", length=session.length)
            self.books.truncating(session, request.length)  # in either tier, before its length changes
            if not session.hot:
                session.length = request.length  # the saved state is cut to this length when restored
                self._reseal(session)
                self.metrics.count("truncates")
                return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail="parked")
            async with self.lifecycle.worker_call(session, refused="truncate failed"):
                session.length = await self.pool.get(session.worker_name).truncate(request.length)
            self.metrics.count("truncates")
            return Done(length=session.length, session_id=session.session_id, epoch=session.epoch)

    async def release(self, request: Release) -> Done:
        check_session_fields(request.session_id, request.epoch, 0)
        await self.gate.fence(request.session_id, request.epoch)
        session = self.books.table.get(request.session_id)
        if session is None:
            return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="no state")
        session.in_flight += 1
        try:
            async with session.lock:
                if self.books.table.get(session.session_id) is session:
                    await self.prefixes.before_release(session)
                    await self.lifecycle.drop(session, MissReason.RELEASED, keep=True)
                    self.metrics.count("releases")
        finally:
            session.in_flight -= 1
        return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="released")

    async def cancel(self, request: Cancel) -> Done:
        check_session_fields(request.session_id, request.epoch, self.gate.length_of(request.session_id, request.epoch))
        if self.books.table.check_epoch(request.session_id, request.epoch) is EpochCheck.STALE:
            raise self.gate.stale(request.session_id, request.epoch)
        session = self.books.table.get(request.session_id)
        if session is None or session.epoch != request.epoch:
            return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="no state")
        self.channels.refresh(session)
        if not session.appending and request.direct_request_id and session.channel and session.hot:
            self.metrics.count("direct_cancels_forwarded")
            self.pool.get(session.worker_name).cancel_direct(session.session_id, session.epoch, request.direct_request_id)
            return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail="cancel requested")
        if not session.appending:
            return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail="nothing in flight")
        self.pool.get(session.worker_name).set_abort(True)
        return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail="cancel requested")

    async def stats(self) -> StatsReply:
        self.channels.refresh()
        workers = self.pool.workers()
        usses = await self.lifecycle.in_thread(lambda: [worker.measure_uss() for worker in workers])
        return build_stats(
            shard=self.shard, books=self.books, pool=self.pool, metrics=self.metrics, vram=self.vram, workers=workers, usses=usses,
            integrity=integrity_of(self.check_integrity), started=self.started, busy=self.channels.busy,
            counters=self.metrics.snapshot() | self.channels.counts() | self.pool.batch_counts() | {"peak_concurrent_compute_threads": self.compute.peak * self.config.worker_threads}
            | self.books.table.fence_counts() | {"admissions_waiting": len(self.admission.queue)},
            calibration=self.calibrator.rows(),
            mode=self.config.mode, mode_detail=self.mode_detail(), huge_pages=self.huge_pages, threads_detail=self.threads_detail,
            keep_warm=self.keep_warm.describe() if self.keep_warm is not None else "",
        )

    def mode_detail(self) -> str:
        return f"{self.mode_reason}; " * bool(self.mode_reason) + self._mode_shape()

    def _mode_shape(self) -> str:
        config = self.config
        if config.batched:
            return (f"--mode batched: {config.worker_processes} worker process(es), {config.seqs_per_worker} sessions each as sequences "
                    f"of one context, {config.worker_threads} llama thread(s) per process; appends that arrive together are decoded together")
        return f"--mode process: one worker process per session ({config.max_sessions}), {config.worker_threads} llama thread(s) each"

    async def park(self, request: Park) -> Done:
        return await self.warm.park(request)

    async def restore(self, request: Restore) -> Done:
        return await self.warm.restore(request)

    async def fork(self, request: Fork) -> Done:
        return await self.warm.fork(request)

    async def lookup_prefix(self, request: PrefixLookup) -> PrefixHeld:
        return await self.prefixes.lookup(request)

    async def admit_prefix(self, request: AdmitPrefix) -> Done:
        return await self.prefixes.admit(request)

    async def export(self, request: Export) -> Exported:
        return await self.transfers.export(request)

    async def import_(self, request: Import) -> Done:
        return await self.transfers.import_(request)

    def close(self, *, keep_spill_files: bool = False) -> None:
        """`keep_spill_files`: a drain parked the sessions to disk for the daemon that follows."""
        self.lifecycle.close()
        self.books.spill.close(keep_files=keep_spill_files)
        self.books.prefixes.close()
        self.vram.close()

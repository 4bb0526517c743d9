"""Request semantics of one shard daemon: the contract routers rely on (see README, "The contract").

Runs on the supervisor's event loop. Owns the session table, the byte budget and the metrics; uses the
worker pool. Worker calls are awaited on the loop (pool.WorkerHandle.call_async); blocking work (memory
readings, starting a replacement worker) runs in threads. Every decision about sessions is made on the
loop between awaits, so the books change atomically.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpool.budget import ByteBudget, OverBudget
from kvpool.config import ServeConfig
from kvpool.gpu import VramMeter
from kvpool.integrity import IntegrityError, require
from kvpool.metrics import Metrics
from kvpool.pool import WorkerHandle, WorkerLost, WorkerPool
from kvpool.protocol import (
    Append,
    AppendReply,
    BudgetRow,
    Cancel,
    Done,
    ErrorCode,
    ErrorReply,
    MissReason,
    Release,
    SessionRow,
    ShardDescription,
    StatsReply,
    Truncate,
    WorkerRow,
)
from kvpool.sessions import EpochCheck, Session, SessionTable
from workers.commands import Appended, CloseContext, Failed, Opened, OpenContext, RunAppend, Truncated, TruncateContext

MAX_SESSION_ID_BYTES = 256
MAX_ADMIT_WAIT_S = 60.0
CALIBRATION_ROWS = 512

log = logging.getLogger("kvpool.serve")


class RequestFailed(Exception):
    """Becomes an ErrorReply; raised anywhere inside a request's handling."""

    def __init__(self, code: ErrorCode, message: str, *, length: int = 0, reason: MissReason | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.length = length
        self.reason = reason


class KvService:
    def __init__(self, config: ServeConfig, pool: WorkerPool, shard: ShardDescription, kv_bytes_per_position: int) -> None:
        self.config = config
        self.pool = pool
        self.shard = shard
        self.kv_bytes_per_position = kv_bytes_per_position
        self.table = SessionTable()
        self.budget = ByteBudget(config.budget_bytes)
        self.metrics = Metrics()
        self.metrics.limit_bytes.set(config.budget_bytes)
        self.vram = VramMeter()
        self.started = time.monotonic()
        self._bound: dict[str, Session] = {}  # worker name -> session
        self._charge_by_n_ctx: dict[int, int] = {}
        self._compute_slots = asyncio.Semaphore(config.concurrent_workers)
        self._computing = 0
        self.peak_computing = 0
        self._executor = ThreadPoolExecutor(max_workers=2 * config.max_sessions + 4, thread_name_prefix="kvpool-call")
        self._capacity_freed = asyncio.Condition()
        self._background: set[asyncio.Task] = set()

    # ---- helpers ----------------------------------------------------------------------------------

    async def _in_thread(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    def check_integrity(self) -> None:
        """Books balance: reserved == sum of live sessions' charges; every worker is free or taken, and the
        workers bound to sessions are taken ones (taken but unbound: in transit)."""
        live = self.table.sessions()
        self.budget.check_integrity(session.key for session in live)
        require(all(self.budget.charge_of(s.key) == s.charged_bytes for s in live), "charge mismatch")
        require({s.worker_name for s in live} == set(self._bound), "bound workers != live sessions' workers")
        self.pool.check_integrity()
        require(set(self._bound) <= self.pool.taken_names(), "a bound worker is not taken from the pool")

    def _session_length(self, session_id: str, epoch: int) -> int:
        session = self.table.get(session_id)
        return session.length if session is not None and session.epoch == epoch else 0

    # ---- calibration: the charge of a context of n_ctx positions ------------------------------------

    async def _calibrate(self, worker: WorkerHandle, n_ctx: int) -> int:
        """Create a context on a taken worker, run one full batch through it, measure, free it."""
        before = await self._in_thread(worker.measure_uss)
        worker.set_abort(False)  # a late cancel of this worker's previous session must not abort this
        reply = await worker.call_async(OpenContext(n_ctx=n_ctx))
        if not isinstance(reply, Opened):
            raise RuntimeError(f"calibration context failed: {reply}")
        rows = min(CALIBRATION_ROWS, n_ctx)
        if self.shard.is_first:
            worker.write_input(np.zeros(rows, np.int32))
        else:
            worker.write_input(np.zeros((rows, self.shard.n_embd), np.float32))
        async with self._computing_slot():
            appended = await worker.call_async(RunAppend(start_pos=0, n_rows=rows, tokens=self.shard.is_first))
        after = await self._in_thread(worker.measure_uss)
        await worker.call_async(CloseContext())
        if not isinstance(appended, Appended):
            raise RuntimeError(f"calibration append failed: {appended}")
        return max(after - before, self.theoretical_kv_bytes(n_ctx))

    async def charge_for(self, n_ctx: int) -> int:
        charge = self._charge_by_n_ctx.get(n_ctx)
        if charge is not None:
            return charge
        worker = self.pool.take_free()
        if worker is None:
            # No free worker to measure on: scale a measured size by the KV difference.
            known_n_ctx, known = next(iter(self._charge_by_n_ctx.items()))
            return known + self.theoretical_kv_bytes(n_ctx) - self.theoretical_kv_bytes(known_n_ctx)
        try:
            charge = await self._calibrate(worker, n_ctx)
        finally:
            self.pool.give_back(worker)
        self._charge_by_n_ctx[n_ctx] = charge
        return charge

    # ---- session lifecycle -----------------------------------------------------------------------

    def _forget(self, session: Session, reason: MissReason) -> WorkerHandle:
        """Synchronous part of dropping a session: table, budget, binding. Returns its worker."""
        self.table.remove(session, reason)
        self.budget.release(session.key)
        self._bound.pop(session.worker_name, None)
        self.metrics.sessions.set(len(self.table))
        self.metrics.reserved_bytes.set(self.budget.reserved)
        return self.pool.get(session.worker_name)

    async def _free_worker(self, worker: WorkerHandle) -> None:
        """Free the worker's context and return it to the pool (or replace it if it died). Whether its
        memory drifted is recycle_drifted()'s business, off this path."""
        try:
            await worker.call_async(CloseContext())
        except WorkerLost:
            await self._replace(worker)
            return
        self.pool.give_back(worker)
        await self._notify_capacity()

    async def _replace(self, worker: WorkerHandle) -> None:
        self.metrics.count("worker_restarts")
        try:
            await self._in_thread(self.pool.replace, worker)
        finally:
            await self._notify_capacity()

    async def _notify_capacity(self) -> None:
        async with self._capacity_freed:
            self._capacity_freed.notify_all()

    async def drop(self, session: Session, reason: MissReason) -> None:
        worker = self._forget(session, reason)
        await self._free_worker(worker)

    def _on_worker_lost(self, session: Session) -> None:
        worker = self._forget(session, MissReason.WORKER_LOST)
        self.metrics.count_error(ErrorCode.WORKER_LOST)
        self._spawn(self._replace(worker))

    async def _fence(self, session_id: str, epoch: int) -> None:
        """Epoch fencing shared by every session request: reject stale, release older state on newer."""
        check = self.table.check_epoch(session_id, epoch)
        if check is EpochCheck.STALE:
            self.metrics.count("stale_epoch_rejects")
            highest = self.table.highest_epoch(session_id)
            raise RequestFailed(ErrorCode.STALE_EPOCH, f"epoch {epoch} is older than {highest}")
        if check is EpochCheck.NEWER:
            old = self.table.get(session_id)
            self.table.see_epoch(session_id, epoch)
            self.table.note_new_epoch(session_id, epoch)
            if old is not None:
                async with old.lock:
                    if self.table.get(session_id) is old:
                        await self.drop(old, MissReason.NEW_EPOCH)
        else:
            self.table.see_epoch(session_id, epoch)

    def _choose_victims(self, charge: int) -> list[Session] | None:
        """LRU idle sessions whose eviction makes room for `charge` bytes and a worker; None if impossible."""
        if self.pool.has_dead_free:
            self._spawn(self.replace_dead_free_workers())
        need_worker = self.pool.free_count == 0
        available = self.budget.available
        victims: list[Session] = []
        for session in self.table.least_recently_used_idle():
            if available >= charge and not (need_worker and not victims):
                break
            victims.append(session)
            available += session.charged_bytes
        if available >= charge and (not need_worker or victims):
            return victims
        return None

    async def _admit(self, request: Append) -> Session:
        n_ctx = request.n_ctx or self.config.n_ctx
        charge = await self.charge_for(n_ctx)
        if charge > self.budget.limit:
            self.metrics.count("over_budget_rejects")
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"a context of n_ctx {n_ctx} needs {charge} bytes, the budget is {self.budget.limit}")
        deadline = time.monotonic() + min(max(request.admit_timeout_s, 0.0), MAX_ADMIT_WAIT_S)
        while True:
            if self.table.get(request.session_id) is not None:
                raise RequestFailed(ErrorCode.POSITION_MISMATCH, "the session was admitted by a concurrent request", length=self._session_length(request.session_id, request.epoch))
            victims = self._choose_victims(charge)
            if victims is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.count("over_budget_rejects")
                raise RequestFailed(
                    ErrorCode.OVER_BUDGET,
                    f"needs {charge} bytes and a worker; {self.budget.available} bytes and "
                    f"{self.pool.free_count} workers free, no idle session to evict",
                )
            async with self._capacity_freed:
                try:
                    await asyncio.wait_for(self._capacity_freed.wait(), remaining)
                except TimeoutError:
                    pass
        # From here to the insertion nothing awaits: the books change in one step.
        worker: WorkerHandle | None = None
        for victim in victims:
            victim_worker = self._forget(victim, MissReason.EVICTED)
            self.metrics.count("evictions")
            if worker is None and self.pool.free_count == 0:
                worker = victim_worker  # taken over directly: opening a context frees the old one first
            else:
                self._spawn(self._free_worker(victim_worker))
        if worker is None:
            worker = self.pool.take_free()
        if worker is None:  # unreachable while _choose_victims counts only usable free workers
            raise RequestFailed(ErrorCode.INTERNAL, "no usable worker although one was counted free")
        session = Session(
            session_id=request.session_id, epoch=request.epoch, n_ctx=n_ctx,
            charged_bytes=charge, worker_name=worker.name, last_used=time.monotonic(),
        )
        self.budget.reserve(session.key, charge)
        self.table.add(session)
        self._bound[worker.name] = session
        session.in_flight += 1
        await session.lock.acquire()
        try:
            reply = await worker.call_async(OpenContext(n_ctx=n_ctx))
            if not isinstance(reply, Opened):
                worker_back = self._forget(session, MissReason.UNKNOWN)
                self._spawn(self._free_worker(worker_back))
                raise RequestFailed(ErrorCode.OVER_BUDGET, f"could not create the context: {reply.message}")
        except WorkerLost as lost:
            self._on_worker_lost(session)
            raise RequestFailed(ErrorCode.WORKER_LOST, f"lost while creating the context: {lost}") from None
        finally:
            session.lock.release()
            session.in_flight -= 1
        self.metrics.count("admissions")
        self.metrics.sessions.set(len(self.table))
        self.metrics.reserved_bytes.set(self.budget.reserved)
        return session

    # ---- requests --------------------------------------------------------------------------------

    def _validate_append(self, request: Append) -> tuple[np.ndarray, int]:
        length = self._session_length(request.session_id, request.epoch)

        def bad(message: str) -> RequestFailed:
            return RequestFailed(ErrorCode.BAD_REQUEST, message, length=length)

        self._validate_session_fields(request.session_id, request.epoch, length)
        if request.start_pos < 0:
            raise bad("start_pos must be >= 0")
        if not 0 <= request.n_ctx <= self.config.n_ctx:
            raise bad(f"n_ctx must be in [0, {self.config.n_ctx}] (0: the default {self.config.n_ctx})")
        if self.shard.is_first:
            if request.tokens is None or request.hidden is not None:
                raise bad("the first shard takes token ids (tokens), not hidden states")
            rows = np.asarray(request.tokens, dtype=np.int64)
            if rows.size and (rows.min() < 0 or rows.max() >= self.shard.n_vocab):
                raise bad(f"token ids must be in [0, {self.shard.n_vocab})")
            rows = rows.astype(np.int32)
        else:
            if request.hidden is None or request.tokens is not None:
                raise bad("this shard takes hidden states (hidden), not token ids")
            row_bytes = self.shard.n_embd * 4
            if len(request.hidden) % row_bytes:
                raise bad(f"hidden must be float32 rows of {self.shard.n_embd} values ({len(request.hidden)} bytes given)")
            rows = np.frombuffer(request.hidden, dtype="<f4").reshape(-1, self.shard.n_embd)
        n_rows = rows.shape[0]
        if n_rows == 0:
            raise bad("an append needs at least one row")
        if n_rows > self.config.n_ctx:
            raise bad(f"{n_rows} rows exceed the daemon's largest context {self.config.n_ctx}")
        return rows, n_rows

    def _validate_session_fields(self, session_id: str, epoch: int, length: int) -> None:
        if not session_id or len(session_id.encode()) > MAX_SESSION_ID_BYTES:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes", length=length)
        if epoch < 0 or epoch >= 2**63:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "epoch must be in [0, 2^63)", length=length)

    async def append(self, request: Append) -> AppendReply:
        rows, n_rows = self._validate_append(request)
        await self._fence(request.session_id, request.epoch)
        session = self.table.get(request.session_id)
        assert session is None or session.epoch == request.epoch, "fencing leaves only the current epoch live"
        admitted = False
        if session is None:
            if request.start_pos > 0:
                reason = self.table.miss_reason(request.session_id, request.epoch)
                self.metrics.count_miss(reason)
                raise RequestFailed(ErrorCode.CACHE_MISS, f"no state for this session at position {request.start_pos}", reason=reason)
            session = await self._admit(request)
            admitted = True
        else:
            self.metrics.count("hits")
        session.in_flight += 1
        try:
            async with session.lock:
                if self.table.get(session.session_id) is not session:
                    reason = self.table.miss_reason(session.session_id, session.epoch)
                    self.metrics.count_miss(reason)
                    raise RequestFailed(ErrorCode.CACHE_MISS, "the session ended while this request waited", reason=reason)
                return await self._append_locked(session, request, rows, n_rows, admitted)
        finally:
            await self._after_request(session)

    async def _append_locked(self, session: Session, request: Append, rows: np.ndarray, n_rows: int, admitted: bool) -> AppendReply:
        if request.start_pos != session.length:
            raise RequestFailed(ErrorCode.POSITION_MISMATCH, f"start_pos {request.start_pos} != session length {session.length}", length=session.length)
        if session.length + n_rows > session.n_ctx:
            raise RequestFailed(ErrorCode.CONTEXT_FULL, f"{session.length} + {n_rows} rows exceed the session's n_ctx {session.n_ctx}", length=session.length)
        worker = self.pool.get(session.worker_name)
        command = RunAppend(start_pos=request.start_pos, n_rows=n_rows, tokens=self.shard.is_first, output_rows=str(request.output_rows))
        worker.set_abort(False)
        session.appending = True
        try:
            reply, data = await self._run_append(worker, command, rows)
        except WorkerLost as lost:
            self._on_worker_lost(session)
            raise RequestFailed(ErrorCode.WORKER_LOST, f"the worker serving this session was lost: {lost}") from None
        finally:
            session.appending = False
            worker.set_abort(False)  # a cancel that arrived as the append finished must not outlive it
        if isinstance(reply, Failed):
            session.length = reply.length
            code = ErrorCode(reply.code) if reply.code in set(ErrorCode) else ErrorCode.INTERNAL
            if code is ErrorCode.CANCELLED:
                self.metrics.count("cancels")
            raise RequestFailed(code, reply.message, length=session.length)
        assert isinstance(reply, Appended)
        session.length = reply.length
        self.metrics.count("appends")
        self.metrics.count("append_rows", n_rows)
        return AppendReply(
            session_id=session.session_id, epoch=session.epoch, length=session.length,
            rows=reply.rows, width=reply.width, data=data, admitted=admitted,
        )

    async def _run_append(self, worker: WorkerHandle, command: RunAppend, rows: np.ndarray) -> tuple[object, bytes]:
        async with self._computing_slot():
            worker.write_input(rows)
            reply = await worker.call_async(command)
        data = worker.read_output(reply) if isinstance(reply, Appended) else b""
        return reply, data

    @contextlib.asynccontextmanager
    async def _computing_slot(self):
        """One of the --threads / --threads-per-worker compute slots; counts the peak in use."""
        async with self._compute_slots:
            self._computing += 1
            self.peak_computing = max(self.peak_computing, self._computing)
            try:
                yield
            finally:
                self._computing -= 1

    async def truncate(self, request: Truncate) -> Done:
        length = self._session_length(request.session_id, request.epoch)
        self._validate_session_fields(request.session_id, request.epoch, length)
        if request.length < 0:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "length must be >= 0", length=length)
        await self._fence(request.session_id, request.epoch)
        session = self.table.get(request.session_id)
        if session is None:
            if request.length == 0:
                return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="no state")
            reason = self.table.miss_reason(request.session_id, request.epoch)
            self.metrics.count_miss(reason)
            raise RequestFailed(ErrorCode.CACHE_MISS, "no state for this session", reason=reason)
        session.in_flight += 1
        try:
            async with session.lock:
                if self.table.get(session.session_id) is not session:
                    raise RequestFailed(ErrorCode.CACHE_MISS, "the session ended while this request waited", reason=self.table.miss_reason(session.session_id, session.epoch))
                if request.length > session.length:
                    raise RequestFailed(ErrorCode.POSITION_MISMATCH, f"cannot truncate to {request.length}: length is {session.length}", length=session.length)
                worker = self.pool.get(session.worker_name)
                try:
                    reply = await worker.call_async(TruncateContext(length=request.length))
                except WorkerLost as lost:
                    self._on_worker_lost(session)
                    raise RequestFailed(ErrorCode.WORKER_LOST, f"the worker serving this session was lost: {lost}") from None
                if not isinstance(reply, Truncated):
                    raise RequestFailed(ErrorCode.INTERNAL, f"truncate failed: {reply}", length=session.length)
                session.length = reply.length
                self.metrics.count("truncates")
                return Done(length=session.length, session_id=session.session_id, epoch=session.epoch)
        finally:
            await self._after_request(session)

    async def _after_request(self, session: Session) -> None:
        session.in_flight -= 1
        session.last_used = time.monotonic()
        if session.in_flight == 0:
            await self._notify_capacity()  # idle now, so evictable: wake admissions waiting for room

    async def release(self, request: Release) -> Done:
        self._validate_session_fields(request.session_id, request.epoch, 0)
        await self._fence(request.session_id, request.epoch)
        session = self.table.get(request.session_id)
        if session is None:
            return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="no state")
        session.in_flight += 1
        try:
            async with session.lock:
                if self.table.get(session.session_id) is session:
                    await self.drop(session, MissReason.RELEASED)
                    self.metrics.count("releases")
        finally:
            session.in_flight -= 1
        return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="released")

    async def cancel(self, request: Cancel) -> Done:
        length = self._session_length(request.session_id, request.epoch)
        self._validate_session_fields(request.session_id, request.epoch, length)
        if self.table.check_epoch(request.session_id, request.epoch) is EpochCheck.STALE:
            self.metrics.count("stale_epoch_rejects")
            raise RequestFailed(ErrorCode.STALE_EPOCH, "stale epoch")
        session = self.table.get(request.session_id)
        if session is None or session.epoch != request.epoch:
            return Done(length=0, session_id=request.session_id, epoch=request.epoch, detail="no state")
        if not session.appending:
            return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail="nothing in flight")
        self.pool.get(session.worker_name).set_abort(True)
        return Done(length=session.length, session_id=session.session_id, epoch=session.epoch, detail="cancel requested")

    async def stats(self) -> StatsReply:
        now = time.monotonic()
        workers = self.pool.workers()
        usses = await self._in_thread(lambda: [worker.measure_uss() for worker in workers])
        by_worker = {session.worker_name: session for session in self.table.sessions()}
        taken = self.pool.taken_names()
        measured = sum(usses)
        self.metrics.measured_bytes.set(measured)
        self.metrics.shared_memory_bytes.set(self.pool.segment_bytes)
        try:
            self.check_integrity()
            integrity = "ok"
        except IntegrityError as error:
            integrity = f"books do not balance: {error}"
        return StatsReply(
            integrity=integrity,
            shard=self.shard,
            sessions=[
                SessionRow(
                    session_id=s.session_id, epoch=s.epoch, length=s.length, n_ctx=s.n_ctx,
                    charged_bytes=s.charged_bytes, idle_s=round(now - s.last_used, 3),
                    worker_pid=self.pool.get(s.worker_name).pid, in_flight=s.in_flight > 0,
                )
                for s in sorted(self.table.sessions(), key=lambda s: s.session_id)
            ],
            workers=[
                WorkerRow(
                    name=w.name, pid=w.pid,
                    state="bound" if w.name in by_worker else "in transit" if w.name in taken else "free",
                    uss_bytes=uss, baseline_uss_bytes=w.baseline_uss,
                    session_id=by_worker[w.name].session_id if w.name in by_worker else "",
                )
                for w, uss in zip(workers, usses)
            ],
            budget=BudgetRow(
                limit_bytes=self.budget.limit, reserved_bytes=self.budget.reserved,
                measured_uss_bytes=measured, measured_vram_bytes=self.vram.used_by({w.pid for w in workers}),
                shared_memory_bytes=self.pool.segment_bytes,
            ),
            counters=self.metrics.snapshot() | {"peak_concurrent_compute_threads": self.peak_computing * self.config.threads_per_worker},
            uptime_s=round(now - self.started, 3),
        )

    # ---- housekeeping ----------------------------------------------------------------------------

    async def expire_idle(self) -> None:
        for session in self.table.expired(time.monotonic(), self.config.ttl_s):
            if session.idle and not session.lock.locked():
                self.metrics.count("expirations")
                await self.drop(session, MissReason.EXPIRED)

    async def replace_dead_free_workers(self) -> None:
        """A free worker that died (nobody was using it) is replaced before anyone is lent it."""
        for worker in self.pool.reap_dead():
            await self._replace(worker)

    async def recycle_drifted(self) -> None:
        """Recycle workers whose measured memory exceeds their charge by more than the margin, when idle."""
        margin = self.config.memory_margin_bytes
        for worker in self.pool.workers():
            session = self._bound.get(worker.name)
            if session is not None and not session.idle:
                continue
            uss = await self._in_thread(worker.measure_uss)
            if session is None and uss:
                worker.baseline_uss = min(worker.baseline_uss, uss)  # the baseline is taken while import pages settle
            drift = uss - worker.baseline_uss
            allowed = (session.charged_bytes if session is not None else 0) + margin
            if drift <= allowed:
                continue
            if session is not None:
                if not session.idle or self._bound.get(worker.name) is not session:
                    continue
                self._forget(session, MissReason.EVICTED)
                self.metrics.count("evictions")
            elif self.pool.take_specific(worker) is None:
                continue
            await self._replace(worker)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.vram.close()

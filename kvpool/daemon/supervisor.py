"""`kvpool serve`: wires the worker pool, the service and the socket together, and tears them down.

Start order: workers (ready acknowledgements), calibration (the charge of every n_ctx, fitted from a
start-up probe that does not fill a context of --n-ctx), socket, metrics endpoint, housekeeping. Teardown runs in reverse; a partial start is
cleaned up the same way.

Stopping: SIGTERM and Shutdown{drain: true} drain first (kvpool.daemon.drain), then say farewell on every
connection (an ErrorReply `draining` as request 0: its client knows a successor may take over the socket)
and tear down; exit status 0. SIGINT and Shutdown{} stop at once, as does a second SIGTERM, a SIGINT or a
Shutdown{} during a drain (exit status 1: sessions were not all kept). No stop removes a spill file: what was
already on disk outlasts every stop, as it would a crash, and only what was in memory is lost.

The spill dir has one owner (kvpool.daemon.books.spill.SpillDirLock, taken by the store): a daemon on a dir
another one owns is refused before any worker starts; one started while the owner tears down waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pathlib
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from kvpool.daemon.admission.calibration import PROBE_PARAMETERS
from kvpool.daemon.admission.probe_cache import FORMAT as PROBE_CACHE_FORMAT
from kvpool.daemon.admission.probe_cache import ProbeCache, ProbeKey, machine_name
from kvpool.daemon.books.sealing import shard_identity
from kvpool.daemon.books.spill import wait_for_disk_dir
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.drain import Drain, DrainOutcome
from kvpool.daemon.keep_warm import KeepWarm
from kvpool.daemon.mode_probe import probe_modes
from kvpool.daemon.notify import Notifier
from kvpool.daemon.pool.handle import PoolSpec
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.pool.shm_room import check_room_for
from kvpool.daemon.pool.spec import shared_settings
from kvpool.daemon.service import KvService
from kvpool.daemon.status import threads_detail
from kvpool.daemon.transport.frames import ConnectionLimits, SocketTransport
from kvpool.daemon.transport.listener import prepare_socket_path
from kvpool.host import format_bytes
from kvpool.shard.digests import verified_digests
from kvpool.shard.header import ShardInfo, read_shard_info
from kvpool.state.header import StateIdentity
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import (
    PROTOCOL_VERSION,
    AdmitPrefix,
    Append,
    Cancel,
    Done,
    ErrorCode,
    ErrorReply,
    Export,
    Fork,
    Hello,
    HelloReply,
    Import,
    Message,
    Park,
    PrefixLookup,
    Release,
    Request,
    Restore,
    ShardDescription,
    Shutdown,
    Stats,
    Truncate,
)
from workers.server.segment import SegmentRegions
from workers.server.spin import kept_said, kept_setting

MEMORY_CHECK_EVERY = 4
MODE_PROBE_N_CTX = 64  # per probe session: its sessions hold a few rows  # housekeeping ticks between measured-memory checks

log = logging.getLogger("kvpool.serve")


def build_pool(config: ServeConfig, info: ShardInfo, kinds: tuple[type, type] | None = None, *, keep_warm_block: str = "") -> WorkerPool:
    """The daemon's worker pool (not started): one worker per session place, segments sized for the shard;
    `keep_warm_block`: the --keep-warm stamp its workers' direct channels touch ("": none)."""
    segment = SegmentRegions.for_shard(info.shape, n_ctx=config.n_ctx, max_request_bytes=config.max_request_bytes)
    return WorkerPool(
        PoolSpec(
            worker=shared_settings(
                shard_path=str(config.model),
                segment=segment,
                n_threads=config.worker_threads,
                flash_attn=config.flash_attn,
                n_gpu_layers=config.n_gpu_layers,
                verbose=config.verbose,
                max_n_ctx=config.n_ctx,
                seqs_per_worker=config.seqs_per_worker if config.batched else 0,
                huge_pages=config.loads_in_huge_pages,
                background_nice=config.background_nice,
                idle_spin=config.idle_spin,
                keep_warm_block=keep_warm_block,
                max_request_bytes=config.max_request_bytes,
            ),
            size=config.max_sessions,
            ready_timeout_s=config.ready_timeout_s,
            request_timeout_s=config.request_timeout_s,
            direct=config.uses_direct_channels,
            kinds=kinds,
            # A semaphore only where the bound can be exceeded: fewer compute slots than worker processes.
            compute_slots=config.concurrent_workers if config.concurrent_workers < config.worker_processes else 0,
            compute_records=str(compute_semaphore_records(config.socket)),
        )
    )


def compute_semaphore_records(socket: pathlib.Path) -> pathlib.Path:
    """The prefix of the records of the semaphores that bound the workers computing at once: each daemon's is
    this and its pid (beside the socket, private; workers.server.compute_semaphore)."""
    return socket.with_name(f".{socket.name}.compute")



class Supervisor:
    def __init__(
        self, config: ServeConfig, *, announce: Callable[[str], None] | None = None, notifier: Notifier | None = None,
        worker_kinds: tuple[type, type] | None = None,
    ) -> None:
        """`worker_kinds`: PoolSpec.kinds (a test double of the worker; None: the real worker process)."""
        self.config = config
        self._worker_kinds = worker_kinds
        self._announce = announce or (lambda message: print(f"kvpool serve: {message}", file=sys.stderr, flush=True))
        self.notifier = notifier or Notifier(None)
        self._stop = asyncio.Event()
        self._drain_requested = False
        self.service: KvService | None = None
        self.drain: Drain | None = None
        self.exit_code = 0  # of `kvpool serve` once run() returns: 1 when a drain was cut short

    def request_stop(self) -> None:
        """Stop at once; during a drain, end the drain where it stands."""
        if self.drain is not None and self.drain.active:
            if not self.drain.done and not self.drain.interrupted:
                self._announce("stop requested during the drain: stopping at once (exit status 1)")
                self.drain.stop_now()
            return
        self.notify_stopping()
        self._stop.set()

    def request_drain(self) -> None:
        """Drain, then stop; a second request during the drain stops at once."""
        if self.drain is not None and self.drain.active:
            self.request_stop()
            return
        self.notify_stopping()  # STOPPING=1 as the drain begins
        self._drain_requested = True
        self._stop.set()

    def notify_stopping(self) -> None:
        """The service manager learns that stopping began (STOPPING=1, sent once)."""
        self.notifier.stopping()

    def _notify_ready(self) -> None:
        """READY=1: called once the socket accepts and every start-up step is done, never before, and never
        after stopping began (a manager told STOPPING=1 is not told READY=1 later)."""
        if self._stop.is_set():
            return
        config = self.config
        self.notifier.ready(f"ready on {config.socket}: {config.max_sessions} sessions ({config.mode} mode)")

    async def run(self) -> None:
        prepare_socket_path(self.config.socket)  # refuse at once when a live daemon serves there
        if self.config.spill_dir is not None:
            await asyncio.to_thread(wait_for_disk_dir, self.config.spill_dir)  # refused before any worker starts
        mode_reason = await self._resolve_mode()
        config = self.config
        info = read_shard_info(config.model)
        block_sha256, shard_sha256 = verified_digests(info)  # WeightsMismatch: refused before any worker starts
        keep_warm = KeepWarm(config.keep_warm_s)
        try:  # until the main try below, whose finally closes it first
            pool = build_pool(config, info, self._worker_kinds, keep_warm_block=keep_warm.name)
            check_room_for(config.worker_processes, pool.spec.worker.segment)
            self._announce(
                f"starting {config.worker_processes} workers on {config.model.name} "
                + (f"(batched: {config.seqs_per_worker} sessions each, one context of {config.seqs_per_worker} x {config.n_ctx} positions; " if config.batched else "(")
                + f"shared memory {format_bytes(pool.spec.worker.segment.total_bytes)} each)"
            )
            loop = asyncio.get_running_loop()
            signals = threading.current_thread() is threading.main_thread()  # a daemon run in a test's thread takes none
            if signals:
                loop.add_signal_handler(signal.SIGTERM, self.request_drain)
                loop.add_signal_handler(signal.SIGINT, self.request_stop)
        except BaseException:
            keep_warm.close()
            raise
        server: SocketTransport | None = None
        housekeeping: asyncio.Task | None = None
        try:
            ready = await asyncio.to_thread(pool.start)
            if self._stop.is_set():
                return
            self.notifier.status(f"{config.worker_processes} workers started; probing charges")
            shard = ShardDescription(shape=ready.shape, model_path=str(config.model), source_sha256=info.source_sha256 or "")
            identity = shard_identity(
                info, shard_sha256=shard_sha256, block_sha256=block_sha256, flash_attn=config.flash_attn, kv_bytes_per_position=ready.kv_bytes_per_position,
                seqs_per_context=config.seqs_per_worker if config.batched else 1,
            )
            self.service = service = KvService(config, pool, shard, ready.kv_bytes_per_position, identity, keep_warm=keep_warm)
            service.huge_pages = f"--huge-pages {config.huge_pages}" + (f"; the first worker's load: {ready.huge_pages}" if ready.huge_pages else "")
            service.threads_detail = threads_detail(config.worker_threads, ready.idle_spin)
            if config.worker_threads > 1 and (kept := kept_setting()):
                self._announce(f"workers' idle llama threads spin {kept_said(kept)}")
            service.mode_reason = mode_reason
            if config.spill_dir is not None:
                self._announce(service.adopt_saved_states())
            self.drain = Drain(service, config.drain_timeout_s, self._announce)  # before the socket: every request is seen
            service.admission.refuse_new = self.drain.refuse_new
            fit = await service.calibrator.calibrate(config.n_ctx, self._probe_cache(identity, ready.idle_spin))
            if self._stop.is_set():
                return
            self.notifier.status(f"charges probed ({fit.probe.filled[-1][0]} cells); opening {config.socket}")
            cached_at = service.calibrator.cached_at
            self._announce(
                f"charges fitted from a start-up probe of {fit.probe.filled[-1][0]} cells"
                + (f" (kept in {config.calibration_cache_dir}, measured {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(cached_at))})" if cached_at is not None else "")
                + ": "
                + ", ".join(
                    f"n_ctx {n_ctx}: {format_bytes(fit.charge(n_ctx))} ({'extrapolated' if fit.probe.extrapolated(n_ctx) else 'measured'} "
                    f"{format_bytes(fit.cost(n_ctx))}, theoretical KV {format_bytes(fit.theoretical_kv_bytes(n_ctx))})"
                    for n_ctx in reversed(fit.sizes()[-2:])
                )
            )
            step_s = service.calibrator.step_s
            self._announce(
                f"min residency {service.admission.residency().min_s * 1000:.0f} ms"
                + (" (--min-residency)" if config.min_residency_s is not None else f" (derived from a decode step of {(step_s or 0) * 1000:.1f} ms)")
            )
            hello = HelloReply(
                version=PROTOCOL_VERSION, shard=shard, max_n_ctx=config.n_ctx, default_n_ctx=config.n_ctx,
                max_request_bytes=config.max_request_bytes, state_identity=identity,
                prefix_block=service.prefixes.block, max_prefix_digests=config.max_prefix_digests if service.prefixes.block else 0,
            )
            limits = ConnectionLimits(
                handshake_timeout_s=config.handshake_timeout_s, frame_timeout_s=config.frame_timeout_s,
                buffered_request_bytes=config.buffered_request_limit_bytes, max_connections=config.max_connections,
            )
            server = SocketTransport(config.socket, hello, self.dispatch, max_request_bytes=config.max_request_bytes, limits=limits)
            if not_started := keep_warm.start():  # asleep until the first session request
                self._announce(f"--keep-warm: {not_started}; serving without them")
            elif keep_warm.hazards:
                self._announce(f"--keep-warm: {keep_warm.hazards} (spinning all the same; --keep-warm 0 turns it off)")
            await server.start()
            if config.metrics_port is not None:
                port = service.metrics.serve_http(config.metrics_port)
                self._announce(f"Prometheus metrics on http://127.0.0.1:{port}/metrics")
            housekeeping = asyncio.create_task(self._housekeeping(service))
            self._announce(
                f"ready on {config.socket}: {shard.shape}, "
                f"{config.worker_processes} worker processes for {config.max_sessions} sessions ({config.mode} mode), budget {format_bytes(config.budget_bytes)}, ttl {config.ttl_s:g} s, "
                f"{config.threads} compute thread(s)"
            )
            self._notify_ready()
            await self._stop.wait()
            if self._drain_requested:
                housekeeping = await self._stopped(housekeeping)  # parks and expiries are the drain's now
                outcome = await self.drain.run()
                self._announce(outcome.line())
                self._after_drain(outcome)
            self._announce("shutting down")
        finally:
            keep_warm.close()  # first: nothing below needs the spinners, and nothing here raises
            if self.service is not None:
                self.service.books.spill.stopping()  # a successor on the spill dir waits from now, not refused
            for signum in (signal.SIGTERM, signal.SIGINT) if signals else ():
                loop.remove_signal_handler(signum)
            await self._stopped(housekeeping)
            if server is not None:
                await server.close(self._farewell())
            for worker in pool.workers():
                worker.set_abort(True)  # interrupt in-flight appends so workers can exit promptly
            await asyncio.to_thread(pool.close)
            if self.service is not None:
                self.service.close(keep_spill_files=True)  # every stop: what is on disk stays for the next daemon
            self._announce("stopped")

    def _probe_cache(self, identity: StateIdentity, idle_spin: str) -> ProbeCache | None:
        """`idle_spin`: how the first worker's idle threads spin (Ready.idle_spin), part of the key where a worker
        has more than one thread (the probe's step time depends on it); nothing for one thread."""
        config = self.config
        directory = config.calibration_cache_dir
        if directory is None:
            return None
        key = ProbeKey(
            format=PROBE_CACHE_FORMAT, identity=identity, mode=config.mode, n_ctx=config.n_ctx, worker_threads=config.worker_threads,
            n_gpu_layers=config.n_gpu_layers, machine=machine_name(), kvpool_probe=PROBE_PARAMETERS, huge_pages=config.loads_in_huge_pages,
            idle_spin=idle_spin if config.worker_threads > 1 else "",
        )
        return ProbeCache(directory, key)

    @staticmethod
    async def _stopped(task: asyncio.Task | None) -> None:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _after_drain(self, outcome: DrainOutcome) -> None:
        if self.drain is not None and self.drain.interrupted:
            self.exit_code = 1
        elif outcome.integrity != "ok":
            self.exit_code = 1

    def _farewell(self) -> ErrorReply | None:
        """After a drain: every connection is told, so its client waits for the daemon that follows."""
        if self.drain is None or not self.drain.active:
            return None
        return ErrorReply(code=ErrorCode.DRAINING, message="this daemon drained and is stopping: connect again for the daemon that takes over the socket")

    async def _resolve_mode(self) -> str:
        """--mode auto: measure both schedules (kvpool.daemon.mode_probe) and run the faster; why, for status."""
        if self.config.mode != "auto":
            return ""
        self._announce(f"--mode auto: measuring the process and batched schedules for {self.config.seqs_per_worker} sessions on {self.config.threads} thread(s)")
        choice = await asyncio.to_thread(
            probe_modes, str(self.config.model), sessions=self.config.seqs_per_worker, threads=self.config.threads, n_ctx=MODE_PROBE_N_CTX,
            huge_pages=self.config.loads_in_huge_pages, idle_spin=self.config.idle_spin,
        )
        self.config = dataclasses.replace(self.config, mode=choice.mode)
        self._announce(choice.reason)
        return choice.reason

    async def _housekeeping(self, service: KvService) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.config.housekeeping_interval_s)
            tick += 1
            try:
                await service.housekeeper.expire_idle()
                await service.housekeeper.free_idle_spares()
                await service.housekeeper.park_idle()
                await service.housekeeper.persist_idle()
                await service.housekeeper.kill_stalled_direct()
                await service.housekeeper.replace_dead_free_workers()
                if tick % MEMORY_CHECK_EVERY == 0:
                    await service.housekeeper.recycle_drifted()
            except Exception:  # noqa: BLE001 - housekeeping must outlive any one failure
                log.error("housekeeping failed:\n%s", traceback.format_exc())

    async def dispatch(self, request: Request) -> Message:
        service = self.service
        assert service is not None
        try:
            with self.drain.taking(request) if self.drain is not None else contextlib.nullcontext():
                return await self._handle(service, request)
        except RequestFailed as failure:
            if failure.code is ErrorCode.BAD_REQUEST:
                service.metrics.count("bad_requests")
            service.metrics.count_error(failure.code)
            return ErrorReply(
                code=failure.code, message=str(failure), length=failure.length, reason=failure.reason, retry_after_s=failure.retry_after_s,
                epoch_floor=failure.epoch_floor,
                session_id=getattr(request, "session_id", ""), epoch=getattr(request, "epoch", 0),
            )
        except Exception as error:  # noqa: BLE001 - a bug must cost one request, never the daemon
            log.error("request %s failed:\n%s", type(request).__name__, traceback.format_exc())
            return ErrorReply(code=ErrorCode.INTERNAL, message=f"internal error: {error}")

    async def _handle(self, service: KvService, request: Request) -> Message:
        match request:
            case Append():
                return await service.append(request)
            case Truncate():
                return await service.truncate(request)
            case Release():
                return await service.release(request)
            case Cancel():
                return await service.cancel(request)
            case Park():
                return await service.park(request)
            case Restore():
                return await service.restore(request)
            case Fork():
                return await service.fork(request)
            case PrefixLookup():
                return await service.lookup_prefix(request)
            case AdmitPrefix():
                return await service.admit_prefix(request)
            case Export():
                return await service.export(request)
            case Import():
                return await service.import_(request)
            case Stats():
                return await service.stats()
            case Shutdown():
                return self._shutdown(request)
            case Hello():
                raise RequestFailed(ErrorCode.BAD_REQUEST, "Hello is only valid as the first frame")
        raise AssertionError(f"unhandled request {request!r}")

    def _shutdown(self, request: Shutdown) -> Done:
        if not request.drain:
            self.request_stop()
            return Done(length=0, detail="stopping at once" if self.drain is not None and self.drain.active else "shutting down")
        if self.drain is not None and self.drain.active:
            return Done(length=0, detail="already draining")
        self.request_drain()
        return Done(length=0, detail="draining")

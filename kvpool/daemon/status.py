"""The daemon's status: the session table, the workers, the budget and the counters as one StatsReply."""

from __future__ import annotations

import time

from kvpool.daemon.books.books import Books
from kvpool.daemon.books.integrity import IntegrityError
from kvpool.daemon.gpu import VramMeter
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.handle import WorkerHandle
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.wire.protocol import BudgetRow, CalibrationRow, PrefixStoreRow, SessionRow, ShardDescription, StatsReply, WorkerRow


def threads_detail(worker_threads: int, idle_spin: str) -> str:
    """The status line of a worker's llama threads and, with more than one (an OpenMP team), how the idle ones
    spin as the first worker reported it (Ready.idle_spin: workers.server.spin)."""
    if worker_threads == 1:
        return "1 llama thread a worker: no OpenMP team, nothing spins idle (--idle-spin has no effect)"
    return f"{worker_threads} llama threads a worker; idle threads spin {idle_spin or 'n/a (not reported)'}"


def integrity_of(check) -> str:
    try:
        check()
    except IntegrityError as error:
        return f"books do not balance: {error}"
    return "ok"


def build_stats(
    *, shard: ShardDescription, books: Books, pool: WorkerPool, metrics: Metrics, vram: VramMeter,
    workers: list[WorkerHandle], usses: list[int], integrity: str, counters: dict[str, int], started: float,
    busy=lambda session: False,
    calibration: list[CalibrationRow],
    mode: str = "process",
    mode_detail: str = "",
    huge_pages: str = "",
    threads_detail: str = "",
    keep_warm: str = "",
) -> StatsReply:
    """`usses` are the measured USS of `workers`, in that order."""
    now = time.monotonic()
    measured = sum(usses)
    metrics.measured_bytes.set(measured)
    metrics.shared_memory_bytes.set(pool.segment_bytes)
    sessions = sorted(books.table.sessions(), key=lambda s: s.session_id)
    return StatsReply(
        integrity=integrity,
        shard=shard,
        sessions=[
            SessionRow(
                session_id=s.session_id, epoch=s.epoch, length=s.length, n_ctx=s.n_ctx,
                charged_bytes=s.charged_bytes if s.hot else 0, idle_s=round(now - s.last_used, 3),
                worker_pid=pool.get(s.worker_name).pid if s.hot else 0, in_flight=s.in_flight > 0 or busy(s),
                tier="hot" if s.hot else books.spill.tier_of(s.key),
            )
            for s in sessions
        ],
        workers=[
            WorkerRow(
                name=w.name, pid=w.pid, state=books.state_of(w.name), uss_bytes=uss, baseline_uss_bytes=w.baseline_uss,
                session_id=bound.session_id if (bound := books.session_of(w.name)) is not None else "",
                spare_bytes=spare.charge if (spare := books.spare_of(w.name)) is not None else 0,
                huge_page_bytes=w.ready.huge_page_bytes if w.ready is not None else 0,
            )
            for w, uss in zip(workers, usses)
        ],
        budget=BudgetRow(
            limit_bytes=books.budget.limit, reserved_bytes=books.session_bytes, spare_bytes=books.spare_bytes,
            measured_uss_bytes=measured, measured_vram_bytes=vram.used_by({w.pid for w in workers}),
            shared_memory_bytes=pool.segment_bytes,
            spill_limit_bytes=books.spill.ram_limit, spill_bytes=books.spill.ram_bytes,
            spill_disk_limit_bytes=books.spill.disk_limit, spill_disk_bytes=books.spill.disk_bytes,
        ),
        counters=counters,
        prefixes=PrefixStoreRow(
            block=books.prefixes.block, limit_bytes=books.prefixes.limit, bytes=books.prefixes.bytes, entries=len(books.prefixes),
            blocks=books.prefixes.blocks, hits=counters.get("prefix_hits", 0), hit_tokens=counters.get("prefix_hit_tokens", 0),
            evictions=books.prefixes.evictions,
        ) if books.prefixes.enabled else None,
        uptime_s=round(now - started, 3),
        calibration=calibration,
        mode=mode,
        mode_detail=mode_detail,
        huge_pages=huge_pages,
        threads_detail=threads_detail,
        keep_warm=keep_warm,
    )

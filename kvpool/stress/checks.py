"""The checks after the run: snapshots, settling, worker memory, daemon summaries and the verdicts."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections import Counter
from collections.abc import Sequence

from kvpool.client.client import Client
from kvpool.host import format_bytes
from kvpool.stress import drill_checks
from kvpool.stress.daemons import Chain
from kvpool.stress.driver import SessionDriver
from kvpool.stress.options import IDLE_MARGIN_S, SPILL_PLACES, StressOptions
from kvpool.stress.report import (
    DaemonSummary,
    PrefixStoreEnd,
    RestartRecord,
    Sample,
    SessionSummary,
    SlowReaderRecord,
    StallRecord,
    SupervisorKillRecord,
    Verdict,
    WorkerMemory,
)
from kvpool.wire.protocol import StatsReply

SETTLE_TIMEOUT_S = 30.0
NOT_COUNTS = ("peak_concurrent_compute_threads", "min_residency_ms", "admission_wait_max_ms")  # values, not counts: shown as they end


# ---- checks after the run ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    stats: StatsReply

    @property
    def uss_by_pid(self) -> dict[int, int]:
        return {worker.pid: worker.uss_bytes for worker in self.stats.workers}


def take_snapshot(sockets: Sequence[pathlib.Path]) -> list[Snapshot]:
    snapshots = []
    for path in sockets:
        with Client(path, timeout_s=30, name="stress-check") as client:
            snapshots.append(Snapshot(client.stats()))
    return snapshots


def _worker_memory(before: Snapshot, after: Snapshot, tolerance: int) -> list[WorkerMemory]:
    rows = []
    pre = before.uss_by_pid
    for worker in after.stats.workers:
        if worker.pid in pre:
            reference, compared_to = pre[worker.pid], "pre-run"
        else:
            reference, compared_to = worker.baseline_uss_bytes, "own baseline"
        delta = worker.uss_bytes - reference
        # a spare context (a parked session's, kept on purpose and charged) is memory the worker may hold
        rows.append(WorkerMemory(worker.pid, reference, worker.uss_bytes, delta, compared_to, -tolerance <= delta <= tolerance + worker.spare_bytes))
    return rows


def _settled(before: Snapshot, after: Snapshot, prefix: str, tolerance: int, workers_expected: int | None) -> bool:
    stats = after.stats
    ours = [row for row in stats.sessions if row.session_id.startswith(prefix)]
    return (
        not ours
        and stats.budget.reserved_bytes == before.stats.budget.reserved_bytes
        and stats.integrity == "ok"
        and (workers_expected is None or len(stats.workers) == workers_expected)
        and all(row.within_tolerance for row in _worker_memory(before, after, tolerance))
    )


def settle_daemons(sockets: Sequence[pathlib.Path], before: Sequence[Snapshot], prefix: str, tolerance: int, workers_expected: int | None) -> list[Snapshot]:
    """Stats of every daemon once everything is back (or as they are when SETTLE_TIMEOUT_S runs out).

    Evicted sessions' contexts are freed in the background and killed workers are replaced
    asynchronously, so the final state is polled for rather than read once.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = take_snapshot(sockets)
        if all(_settled(b, a, prefix, tolerance, workers_expected) for b, a in zip(before, after)) or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def daemon_summaries(chain: Chain, before: Sequence[Snapshot], after: Sequence[Snapshot], samples: Sequence[Sample], tolerance: int, prefix: str, restarted: frozenset[int] = frozenset()) -> list[DaemonSummary]:
    summaries = []
    for index, (b, a) in enumerate(zip(before, after)):
        shard = a.stats.shard
        peak = max((s.reserved_bytes for s in samples if s.daemon == index), default=0)
        after_pids = {w.pid for w in a.stats.workers}
        since = {} if index in restarted else b.stats.counters  # a restarted daemon counts from its restart
        summaries.append(
            DaemonSummary(
                socket=str(chain.sockets[index]), layers=f"[{shard.shape.layer_start}, {shard.shape.layer_stop})",
                limit_bytes=a.stats.budget.limit_bytes, session_charge_bytes=chain.charges[index] if chain.charges else 0,
                peak_reserved_bytes=peak, reserved_before=b.stats.budget.reserved_bytes, reserved_after=a.stats.budget.reserved_bytes,
                our_sessions_after=sum(row.session_id.startswith(prefix) for row in a.stats.sessions), integrity_after=a.stats.integrity,
                counters={key: value - since.get(key, 0) for key, value in sorted(a.stats.counters.items()) if key not in NOT_COUNTS}
                | {key: a.stats.counters.get(key, 0) for key in NOT_COUNTS},
                workers=_worker_memory(b, a, tolerance), replaced_pids=sorted(set(b.uss_by_pid) - after_pids),
                restarted=index in restarted, prefix_store=_prefix_store(a.stats),
            )
        )
    return summaries


def _prefix_store(stats: StatsReply) -> PrefixStoreEnd | None:
    row = stats.prefixes
    return None if row is None else PrefixStoreEnd(row.block, row.limit_bytes, row.bytes, row.entries, row.blocks)


@dataclasses.dataclass(slots=True)
class DrillFacts:
    """What the fault drills recorded during the run, for their verdicts."""

    supervisor_kills: list[SupervisorKillRecord] = dataclasses.field(default_factory=list)
    restarts: list[RestartRecord] = dataclasses.field(default_factory=list)
    restart_error: str = ""  # the rolling restart stopped: a successor did not start
    stalls: list[StallRecord] = dataclasses.field(default_factory=list)
    slow_reader: SlowReaderRecord | None = None
    leftover_pids: list[int] | None = None  # None: the daemons were not started here (attached)
    leftover_segments: list[str] = dataclasses.field(default_factory=list)
    sampler_gaps: int = 0
    second_chain: list[DaemonSummary] = dataclasses.field(default_factory=list)  # --replan's second chain, at the end


def build_verdicts(options: StressOptions, chain: Chain, drivers: Sequence[SessionDriver], sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], samples: Sequence[Sample], sampler_failures: Sequence[str], drills: DrillFacts | None = None) -> tuple[list[Verdict], list[str]]:
    """Every verdict of the run, and the warnings (what could not be exercised; never a failure)."""
    drills = drills or DrillFacts()
    verdicts: list[Verdict] = []
    warnings: list[str] = []

    def add(name: str, passed: bool, detail: str) -> None:
        verdicts.append(Verdict(name, bool(passed), detail))

    violations = [v for s in sessions for v in s.violations]
    add("contract", not violations, "every reply was one the contract allows" if not violations else "; ".join(violations)[:2000])
    mismatches = [m for s in sessions for m in s.mismatches]
    rows = sum(s.checked_rows for s in sessions)
    greedy = sum(s.greedy_checked for s in sessions)
    exact = not mismatches and not violations and all(s.final_logits_max_abs_diff == 0.0 for s in sessions)
    add("exact", exact, f"{rows} output rows, {greedy} greedy tokens and {len(sessions)} final logits identical to each session alone" if exact else "; ".join(mismatches)[:2000] or "a session did not finish")
    operations, missing = drill_checks.operations_verdict(options, sessions, len(chain.sockets))
    verdicts.append(operations)
    warnings += missing
    over = [s for s in samples if s.reserved_bytes > s.limit_bytes or s.integrity != "ok"]
    gaps = f" ({drills.sampler_gaps} skipped while a killed daemon restarted)" if drills.sampler_gaps else ""
    add("books_at_every_sample", not over and bool(samples) and not sampler_failures,
        f"{len(samples)} samples{gaps}: reserved <= limit and the books balance at each" if not over and samples and not sampler_failures
        else f"{len(over)} bad samples, e.g. {over[0] if over else None}; {list(sampler_failures)}")
    back = all(not d.our_sessions_after and d.reserved_after == d.reserved_before and d.integrity_after == "ok" for d in daemons)
    add("released", back, "no session left, reserved bytes back to " + ", ".join(format_bytes(d.reserved_after) for d in daemons) + ", integrity ok on every daemon"
        if back else "; ".join(f"daemon {i}: {d.our_sessions_after} sessions left, reserved {d.reserved_before} -> {d.reserved_after}, books {d.integrity_after}" for i, d in enumerate(daemons)))
    memory = [(i, w) for i, d in enumerate(daemons) for w in d.workers]
    bad = [(i, w) for i, w in memory if not w.within_tolerance]
    worst = max((abs(w.delta_bytes) for _i, w in memory), default=0)
    add("worker_memory", not bad, f"{len(memory)} workers within {format_bytes(options.uss_tolerance_bytes)} of their pre-run USS (largest |delta| {format_bytes(worst)})"
        if not bad else "; ".join(f"daemon {i} pid {w.pid}: {format_bytes(w.before_bytes)} -> {format_bytes(w.after_bytes)}" for i, w in bad))
    if drills.leftover_pids is not None:
        verdicts.append(drill_checks.leftovers_verdict(drills.leftover_pids, drills.leftover_segments))
    if options.budget_for is not None:
        evictions = [d.counters.get("evictions", 0) for d in daemons]
        evicted_misses = sum(s.misses.get("evicted", 0) for s in sessions)
        peaks = all(d.peak_reserved_bytes <= d.limit_bytes for d in daemons)
        # With residency on, the admission queue may place every session without evicting one: not exercised
        # (a warning), as long as the budget held and every session is exact.
        # An evicted session shows cache_miss/evicted only if it appends to that daemon again before its epoch
        # moves on or it finishes; with residency on, which sessions come back is a matter of timing.
        residency = options.min_residency_s != 0
        spared = not sum(evictions) and residency
        unseen = sum(evictions) > 0 and not evicted_misses and residency
        passed = (sum(evictions) > 0 and evicted_misses > 0 or spared or unseen) and peaks and exact
        if spared:
            warnings.append("no session was evicted: residency and the admission queue placed every one without an eviction (LRU eviction not exercised)")
        if unseen:
            warnings.append("sessions were evicted but none appended to that daemon again in the same epoch (no cache_miss/evicted to replay)")
        add("lru_eviction", passed, f"evictions per daemon {evictions}, {evicted_misses} cache_miss/evicted seen and replayed from 0, all exact; "
            f"peak reserved " + ", ".join(f"{format_bytes(d.peak_reserved_bytes)}/{format_bytes(d.limit_bytes)}" for d in daemons))
    if options.spill:
        misses = sum(sum(s.misses.values()) for s in sessions)
        restores = [d.counters.get("restores", 0) for d in daemons]
        spills = [d.counters.get("spills", 0) for d in daemons]
        passed = misses == 0 and all(restores) and exact
        add("warm_tier", passed, f"{options.sessions} sessions on {SPILL_PLACES} places per daemon: "
            f"spills per daemon {spills}, restores {restores}, {misses} cache misses that lost a session's state (planned epoch probes aside), all exact")
    if options.shared_prefix:
        verdict, prefix_warnings = drill_checks.shared_prefix_verdict(sessions, daemons, exact)
        verdicts.append(verdict)
        warnings += prefix_warnings
    if options.budget_for is not None or options.spill or options.shared_prefix:  # more sessions than places
        verdicts.append(drill_checks.progress_verdict(options, sessions, daemons, exact))
    if options.ttl_s is not None:
        results = [result for driver in drivers for result in driver.idle_results]
        expirations = [d.counters.get("expirations", 0) for d in daemons]
        passed = bool(results) and all(r == "cache_miss/expired" for r in results) and sum(expirations) >= len(results) and exact
        add("ttl_expiry", passed, f"{len(results)} sessions idle {options.ttl_s + IDLE_MARGIN_S:g} s: next request answered {Counter(results)}; expirations per daemon {expirations}")
    if options.kill_worker:
        verdicts.append(drill_checks.kill_worker_verdict(drivers, sessions, daemons, chain.workers_expected, exact))
    if options.kill_supervisor:
        verdicts.append(drill_checks.kill_supervisor_verdict(drills.supervisor_kills, sessions, daemons, samples, exact, options.persist_after_s))
    if options.restart:
        verdicts.append(drill_checks.restart_verdict(drills.restarts, drills.restart_error, sessions, len(chain.sockets), exact))
    if options.stall_worker:
        verdicts.append(drill_checks.stall_worker_verdict(drills.stalls, sessions, daemons, chain.workers_expected, exact))
    if options.slow_reader:
        verdict, slow_warnings = drill_checks.slow_reader_verdict(drills.slow_reader, exact)
        verdicts.append(verdict)
        warnings += slow_warnings
    if options.replan:
        verdict, replan_warnings = drill_checks.replan_verdict(drivers, drills.second_chain, exact)
        verdicts.append(verdict)
        warnings += replan_warnings
    return verdicts, warnings

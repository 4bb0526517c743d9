"""The daemons under test, and the checks after the run: snapshots, settling, worker memory, verdicts."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections import Counter
from collections.abc import Sequence

from kvpool.client import Client
from kvpool.config import format_bytes
from kvpool.daemon_route import DaemonRoute
from kvpool.launcher import Daemon, start_daemons
from kvpool.protocol import StatsReply
from kvpool.stress.driver import SessionDriver
from kvpool.stress.options import FORCED_KINDS, IDLE_MARGIN_S, UNLIMITED_BUDGET, OpKind, StressOptions
from kvpool.stress.report import DaemonSummary, Sample, SessionSummary, Verdict, WorkerMemory

SETTLE_TIMEOUT_S = 30.0


# ---- daemons ------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Chain:
    """The daemons under test: started here (daemons set) or attached to (sockets only)."""

    sockets: list[pathlib.Path]
    shard_paths: list[pathlib.Path]
    daemons: list[Daemon]
    charges: list[int]
    workers_expected: int | None


def _stop(daemons: Sequence[Daemon]) -> list[int]:
    return [daemon.stop() for daemon in reversed(daemons)][::-1]


def _serve_options(options: StressOptions, *, max_sessions: int, budget: str, ttl_s: float) -> list[str]:
    return [
        "--threads", "1", "--n-ctx", str(options.n_ctx), "--max-sessions", str(max_sessions),
        "--budget", budget, "--ttl", f"{ttl_s:g}",
    ]


def _probe_charges(shards: Sequence[pathlib.Path], socket_dir: pathlib.Path, options: StressOptions, prompt: Sequence[int]) -> list[int]:
    """One session's charge on each daemon, measured by admitting a probe session."""
    daemons = start_daemons(shards, socket_dir, _serve_options(options, max_sessions=1, budget=UNLIMITED_BUDGET, ttl_s=300), prefix="probe")
    try:
        clients = [daemon.client() for daemon in daemons]
        try:
            route = DaemonRoute(clients)
            route.append("stress-probe", 1, 0, prompt)
            charges = [next(row.charged_bytes for row in client.stats().sessions) for client in clients]
            route.release("stress-probe", 1)
            return charges
        finally:
            for client in clients:
                client.close()
    finally:
        _stop(daemons)


# ---- checks after the run ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    stats: StatsReply

    @property
    def uss_by_pid(self) -> dict[int, int]:
        return {worker.pid: worker.uss_bytes for worker in self.stats.workers}


def _snapshot(sockets: Sequence[pathlib.Path]) -> list[Snapshot]:
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
        rows.append(WorkerMemory(worker.pid, reference, worker.uss_bytes, delta, compared_to, abs(delta) <= tolerance))
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


def _settle(sockets: Sequence[pathlib.Path], before: Sequence[Snapshot], prefix: str, tolerance: int, workers_expected: int | None) -> list[Snapshot]:
    """Stats of every daemon once everything is back (or as they are when SETTLE_TIMEOUT_S runs out).

    Evicted sessions' contexts are freed in the background and killed workers are replaced
    asynchronously, so the final state is polled for rather than read once.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = _snapshot(sockets)
        if all(_settled(b, a, prefix, tolerance, workers_expected) for b, a in zip(before, after)) or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def _daemon_summaries(chain: Chain, before: Sequence[Snapshot], after: Sequence[Snapshot], samples: Sequence[Sample], tolerance: int, prefix: str) -> list[DaemonSummary]:
    summaries = []
    for index, (b, a) in enumerate(zip(before, after)):
        shard = a.stats.shard
        peak = max((s.reserved_bytes for s in samples if s.daemon == index), default=0)
        after_pids = {w.pid for w in a.stats.workers}
        summaries.append(
            DaemonSummary(
                socket=str(chain.sockets[index]), layers=f"[{shard.layer_start}, {shard.layer_stop})",
                limit_bytes=a.stats.budget.limit_bytes, session_charge_bytes=chain.charges[index] if chain.charges else 0,
                peak_reserved_bytes=peak, reserved_before=b.stats.budget.reserved_bytes, reserved_after=a.stats.budget.reserved_bytes,
                our_sessions_after=sum(row.session_id.startswith(prefix) for row in a.stats.sessions), integrity_after=a.stats.integrity,
                counters={key: value - b.stats.counters.get(key, 0) for key, value in sorted(a.stats.counters.items()) if key != "peak_concurrent_compute_threads"}
                | {"peak_concurrent_compute_threads": a.stats.counters.get("peak_concurrent_compute_threads", 0)},
                workers=_worker_memory(b, a, tolerance), replaced_pids=sorted(set(b.uss_by_pid) - after_pids),
            )
        )
    return summaries


def _verdicts(options: StressOptions, chain: Chain, drivers: Sequence[SessionDriver], sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], samples: Sequence[Sample], sampler_failures: Sequence[str]) -> list[Verdict]:
    verdicts: list[Verdict] = []

    def add(name: str, passed: bool, detail: str) -> None:
        verdicts.append(Verdict(name, bool(passed), detail))

    violations = [v for s in sessions for v in s.violations]
    add("contract", not violations, "every reply was one the contract allows" if not violations else "; ".join(violations)[:2000])
    mismatches = [m for s in sessions for m in s.mismatches]
    rows = sum(s.checked_rows for s in sessions)
    greedy = sum(s.greedy_checked for s in sessions)
    exact = not mismatches and not violations and all(s.final_logits_max_abs_diff == 0.0 for s in sessions)
    add("exact", exact, f"{rows} output rows, {greedy} greedy tokens and {len(sessions)} final logits identical to each session alone" if exact else "; ".join(mismatches)[:2000] or "a session did not finish")
    if options.ops >= 2 * len(FORCED_KINDS):
        done = Counter()
        for summary in sessions:
            done.update(summary.ops)
        wanted = [str(kind) for kind in FORCED_KINDS] + [str(OpKind.PREFILL), str(OpKind.DECODE)] + ([str(OpKind.IDLE)] if options.ttl_s is not None else [])
        landed = sum(s.cancels_landed for s in sessions)
        completed = sum(s.cancels_completed for s in sessions)
        missing = [kind for kind in wanted if not done[kind]]
        if options.budget_for is None:  # under budget pressure an eviction may cut any cancel short
            missing += (["cancel landing mid-prefill"] if not landed else []) + (["cancel after completion"] if not completed else [])
        add("operations", not missing, ("every kind exercised: " + ", ".join(f"{k} {done[k]}" for k in wanted) + f"; cancels landed mid-prefill {landed}, sent after completion {completed}") if not missing else f"never exercised: {missing}")
    over = [s for s in samples if s.reserved_bytes > s.limit_bytes or s.integrity != "ok"]
    add("books_at_every_sample", not over and bool(samples) and not sampler_failures,
        f"{len(samples)} samples: reserved <= limit and the books balance at each" if not over and samples and not sampler_failures
        else f"{len(over)} bad samples, e.g. {over[0] if over else None}; {list(sampler_failures)}")
    back = all(not d.our_sessions_after and d.reserved_after == d.reserved_before and d.integrity_after == "ok" for d in daemons)
    add("released", back, "no session left, reserved bytes back to " + ", ".join(format_bytes(d.reserved_after) for d in daemons) + ", integrity ok on every daemon"
        if back else "; ".join(f"daemon {i}: {d.our_sessions_after} sessions left, reserved {d.reserved_before} -> {d.reserved_after}, books {d.integrity_after}" for i, d in enumerate(daemons)))
    memory = [(i, w) for i, d in enumerate(daemons) for w in d.workers]
    bad = [(i, w) for i, w in memory if not w.within_tolerance]
    worst = max((abs(w.delta_bytes) for _i, w in memory), default=0)
    add("worker_memory", not bad, f"{len(memory)} workers within {format_bytes(options.uss_tolerance_bytes)} of their pre-run USS (largest |delta| {format_bytes(worst)})"
        if not bad else "; ".join(f"daemon {i} pid {w.pid}: {format_bytes(w.before_bytes)} -> {format_bytes(w.after_bytes)}" for i, w in bad))
    if options.budget_for is not None:
        evictions = [d.counters.get("evictions", 0) for d in daemons]
        evicted_misses = sum(s.misses.get("evicted", 0) for s in sessions)
        peaks = all(d.peak_reserved_bytes <= d.limit_bytes for d in daemons)
        passed = sum(evictions) > 0 and evicted_misses > 0 and peaks and exact
        add("lru_eviction", passed, f"evictions per daemon {evictions}, {evicted_misses} cache_miss/evicted seen and replayed from 0, all exact; "
            f"peak reserved " + ", ".join(f"{format_bytes(d.peak_reserved_bytes)}/{format_bytes(d.limit_bytes)}" for d in daemons))
    if options.ttl_s is not None:
        results = [result for driver in drivers for result in driver.idle_results]
        expirations = [d.counters.get("expirations", 0) for d in daemons]
        passed = bool(results) and all(r == "cache_miss/expired" for r in results) and sum(expirations) >= len(results) and exact
        add("ttl_expiry", passed, f"{len(results)} sessions idle {options.ttl_s + IDLE_MARGIN_S:g} s: next request answered {Counter(results)}; expirations per daemon {expirations}")
    if options.kill_worker:
        kills = [driver.kill for driver in drivers if driver.kill is not None]
        if not kills:
            add("kill_worker", False, "the planned kill never happened (the session never decoded while live)")
        else:
            kill = kills[0]
            victim = next(d for d in drivers if d.kill is kill)
            daemon = daemons[kill.daemon]
            replaced = kill.pid not in {w.pid for w in daemon.workers} and (chain.workers_expected is None or len(daemon.workers) == chain.workers_expected)
            others = [s for s in sessions if s.session_id != victim.session_id]
            others_exact = all(not s.mismatches and not s.violations for s in others)
            reported = kill.reply in ("worker_lost", "cache_miss/worker_lost")
            passed = reported and replaced and others_exact and exact and daemon.counters.get("worker_restarts", 0) >= 1
            add("kill_worker", passed, f"SIGKILL pid {kill.pid} (daemon {kill.daemon}, {kill.session_id} at length {kill.length}): answered {kill.reply}; "
                f"replayed from 0 at epoch {victim.epoch}; worker replaced: {replaced}; other sessions exact: {others_exact} "
                f"(their recoveries: {sum(s.recoveries for s in others)})")
    return verdicts

"""The report of a stress run (also the --json document) and its table."""

from __future__ import annotations

import msgspec

from kvpool.config import format_bytes


# ---- the report (also the --json document) --------------------------------------------------------------


class Latency(msgspec.Struct):
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


class Sample(msgspec.Struct):
    t_s: float
    daemon: int
    reserved_bytes: int
    limit_bytes: int
    measured_uss_bytes: int
    sessions: int
    integrity: str


class Verdict(msgspec.Struct):
    name: str
    passed: bool
    detail: str


class SessionSummary(msgspec.Struct):
    session_id: str
    prompt_tokens: int
    ops: dict[str, int]
    appends: int
    resets: int
    recoveries: int
    misses: dict[str, int]
    cancels_landed: int
    cancels_completed: int
    final_epoch: int
    final_length: int
    generated: list[int]
    checked_rows: int
    greedy_checked: int
    final_logits_max_abs_diff: float | None
    mismatches: list[str]
    violations: list[str]
    unexercised: list[str]


class WorkerMemory(msgspec.Struct):
    pid: int
    before_bytes: int
    after_bytes: int
    delta_bytes: int
    compared_to: str  # "pre-run" or "own baseline" (a worker started during the run)
    within_tolerance: bool


class DaemonSummary(msgspec.Struct):
    socket: str
    layers: str
    limit_bytes: int
    session_charge_bytes: int
    peak_reserved_bytes: int
    reserved_before: int
    reserved_after: int
    our_sessions_after: int
    integrity_after: str
    counters: dict[str, int]
    workers: list[WorkerMemory]
    replaced_pids: list[int]


class KillRecord(msgspec.Struct):
    session_id: str
    daemon: int
    pid: int
    epoch: int
    length: int
    reply: str = ""


class StressReport(msgspec.Struct):
    scenario: str
    options: dict[str, object]
    reference: str
    duration_s: float
    ops_by_kind: dict[str, int]
    latency_ms: dict[str, Latency]
    errors_by_code: dict[str, int]
    events: dict[str, int]
    uss_tolerance_bytes: int
    samples: list[Sample]
    sessions: list[SessionSummary]
    daemons: list[DaemonSummary]
    kills: list[KillRecord]
    verdicts: list[Verdict]
    passed: bool


# ---- the table -----------------------------------------------------------------------------------------


def render(report: StressReport) -> str:
    options = report.options
    lines = [
        f"kvpool stress: scenario {report.scenario}, {options['sessions']} sessions x {options['ops']} ops, seed {options['seed']}, "
        f"n_ctx {options['n_ctx']}, reference: {report.reference}, {report.duration_s:.1f} s",
        "",
        f"{'OPERATION':<16} {'COUNT':>6} {'P50 ms':>9} {'P90 ms':>9} {'P99 ms':>9} {'MAX ms':>9}",
    ]
    for kind, latency in report.latency_ms.items():
        lines.append(f"{kind:<16} {latency.count:>6} {latency.p50_ms:>9.2f} {latency.p90_ms:>9.2f} {latency.p99_ms:>9.2f} {latency.max_ms:>9.2f}")
    errors = ", ".join(f"{key} {count}" for key, count in report.errors_by_code.items()) or "none"
    lines += ["", f"error replies (expected ones included): {errors}"]
    if report.events:
        lines.append("events: " + ", ".join(f"{key} {count}" for key, count in report.events.items()))
    lines += ["", f"{'SESSION':<22} {'OPS':>4} {'APPENDS':>7} {'RESETS':>6} {'RECOV':>5} {'EPOCH':>5} {'LEN':>4} {'ROWS=':>5} {'GREEDY=':>7}  RESULT"]
    for s in report.sessions:
        result = "exact" if not s.mismatches and not s.violations and s.final_logits_max_abs_diff == 0.0 else "FAIL"
        lines.append(
            f"{s.session_id[-22:]:<22} {sum(s.ops.values()):>4} {s.appends:>7} {s.resets:>6} {s.recoveries:>5} {s.final_epoch:>5} "
            f"{s.final_length:>4} {s.checked_rows:>5} {s.greedy_checked:>7}  {result}"
        )
    lines += ["", f"{'DAEMON':<7} {'LAYERS':<9} {'LIMIT':>10} {'PEAK RES':>10} {'RES AFTER':>10} {'EVICT':>5} {'EXPIRE':>6} {'RESTART':>7} {'CANCEL':>6}  WORKER USS max |delta|"]
    for index, d in enumerate(report.daemons):
        worst = max((abs(w.delta_bytes) for w in d.workers), default=0)
        lines.append(
            f"{index:<7} {d.layers:<9} {format_bytes(d.limit_bytes):>10} {format_bytes(d.peak_reserved_bytes):>10} {format_bytes(d.reserved_after):>10} "
            f"{d.counters.get('evictions', 0):>5} {d.counters.get('expirations', 0):>6} {d.counters.get('worker_restarts', 0):>7} "
            f"{d.counters.get('cancels', 0):>6}  {format_bytes(worst)} (tolerance {format_bytes(report.uss_tolerance_bytes)})"
        )
    lines += ["", "VERDICTS"]
    for verdict in report.verdicts:
        lines.append(f"  {'PASS' if verdict.passed else 'FAIL'}  {verdict.name:<22} {verdict.detail}")
    lines += ["", f"RESULT: {'PASS' if report.passed else 'FAIL'}"]
    return "\n".join(lines)

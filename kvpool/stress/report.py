"""The report of a stress run (also the --json document) and its table."""

from __future__ import annotations

import msgspec

from kvpool.host import format_bytes

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
    reserved_bytes: int  # what the budget holds: the sessions' charges and the spares'
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
    late_cancels: int = 0  # cancels sent to every daemon after the append completed, each answered correctly
    cancels_landed_on: dict[int, int] = msgspec.field(default_factory=dict)  # daemon -> mid-prefill cancels landed there
    cancel_attempts_missed: int = 0  # mid-prefill cancels whose append completed first (timing; retried)
    cancel_targets_missed: list[str] = msgspec.field(default_factory=list)  # planned cancels never exercised (warnings)
    connection_losses: int = 0  # ConnectionLost seen because a supervisor was killed (then recovered)
    release_reconnects: int = 0  # ConnectionLost at the session's final release (released again; nothing to replay)
    failed_op: str = ""  # the operation during which the session broke the contract, if any
    completed_s: float | None = None  # from the start of the sessions to this one's last operation (None: did not finish)
    admissions: int = 0  # appends that admitted the session on a daemon (first appends and replays)
    max_admission_wait_s: float = 0.0  # the longest of them: the daemon's line and the router's back-off included
    full_replays: int = 0  # replays from position 0: the router's, and the driver's own after a lost connection
    full_replayed_tokens: int = 0  # the tokens the router's full replays sent
    tail_replays: int = 0  # the router's replays from the shortest length a daemon held (kvpool.router.session)
    tail_replayed_tokens: int = 0
    position_mismatches: int = 0  # a daemon held fewer of the session's tokens than the router sent it
    restores: int = 0  # appends answered restored: true (the session was parked, or adopted by a successor)
    # --shared-prefix (kvpool.stress.prefixes): what its prompt begins with, and what the router reused for it
    prompt_kind: str = ""
    shared_tokens: int = 0  # the longest prefix its prompt shares with another session's
    prefix_hits: int = 0  # starts (and replays) from a prefix every daemon held (kvpool.router.recovery.RecoveryCounts)
    prefix_hit_tokens: int = 0
    prefix_fallbacks: int = 0  # a prefix found on every daemon but not admitted on one: computed instead
    prefix_starts: list[int] = msgspec.field(default_factory=list)  # positions each fresh start took from a stored prefix (0: none), first start first


class WorkerMemory(msgspec.Struct):
    pid: int
    before_bytes: int
    after_bytes: int
    delta_bytes: int
    compared_to: str  # "pre-run" or "own baseline" (a worker started during the run)
    within_tolerance: bool


class PrefixStoreEnd(msgspec.Struct):
    """A daemon's prefix store at the end of the run (kvpool.wire.protocol.PrefixStoreRow)."""

    block: int
    limit_bytes: int
    bytes: int
    entries: int
    blocks: int


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
    restarted: bool = False  # restarted during the run (--kill-supervisor, --restart): counters are since the restart
    prefix_store: PrefixStoreEnd | None = None  # None: it keeps none


class KillRecord(msgspec.Struct):
    session_id: str
    daemon: int
    pid: int
    epoch: int
    length: int
    reply: str = ""


class StallRecord(msgspec.Struct):
    """--stall-worker: the worker SIGSTOPped before one of its session's appends, and what came of it."""

    session_id: str
    daemon: int
    pid: int
    epoch: int
    length: int
    timeout_s: float  # the daemon's --request-timeout
    reply: str = ""
    elapsed_s: float = 0.0  # from the SIGSTOP to the reply
    continued_by_driver: bool = False  # the daemon never answered: the driver sent SIGCONT (a hang)
    worker_gone: bool = False  # the stopped pid was gone (or a zombie) soon after the reply
    left_stopped: bool = False  # still alive and stopped at the end of the run (then SIGCONT + SIGKILL)


class SavedState(msgspec.Struct):
    """A session's state as a daemon adopted it from its disk tier, or as a copy written behind there."""

    session_id: str
    epoch: int
    length: int


class SupervisorKillRecord(msgspec.Struct):
    """--kill-supervisor: one daemon's supervisor SIGKILLed, its processes and segments, and the restart."""

    daemon: int
    pid: int
    session_id: str
    op_index: int
    descendants: list[int]  # pids of the supervisor's processes (workers, resource tracker) at the kill
    segments: list[str]  # /dev/shm segments those processes had mapped
    all_gone_s: float | None = None  # seconds from the kill until every descendant was gone (None: some outlived the hang guard)
    # still alive at the hang guard, processes.ORPHAN_HANG_GUARD_S after the kill (then killed); the name is
    # the report's since the limit was a 5 s deadline
    orphans_at_deadline: list[int] = msgspec.field(default_factory=list)
    segments_left: list[str] = msgspec.field(default_factory=list)  # still in /dev/shm once its processes were gone (then unlinked)
    restarted_by: str = ""
    restart_s: float = 0.0
    new_pid: int = 0
    restart_error: str = ""
    # with --persist-after: the killed session's copy on that daemon's disk tier when it was killed, how long
    # its idle wait for that copy took, and what the restarted daemon adopted (its stats before any session
    # reached it) with its adoption log line
    victim_copy: SavedState | None = None
    copy_wait_s: float = 0.0
    adopted: list[SavedState] = msgspec.field(default_factory=list)
    adoption_line: str = ""


class RestartRecord(msgspec.Struct):
    """--restart: one daemon drained (SIGTERM) mid-run, and its successor on the same socket and spill dir."""

    daemon: int
    pid: int
    at_ops: int  # operations the run had done when the drain began
    descendants: list[int] = msgspec.field(default_factory=list)  # its processes (workers) at the SIGTERM
    exit_code: int | None = None  # the drained daemon's (0: a drain)
    drain_s: float = 0.0  # SIGTERM to its exit
    drain_line: str = ""  # its "drain done: ..." log line
    left_alive: list[int] = msgspec.field(default_factory=list)  # its processes still alive at the hang guard (then killed)
    workers_gone_s: float = 0.0  # from its exit until the last of its processes was gone
    new_pid: int = 0
    restart_s: float = 0.0  # the successor's start until it answered on the socket
    adopted: list[SavedState] = msgspec.field(default_factory=list)  # parked states the successor had adopted (its stats once it answered)
    adoption_line: str = ""
    restart_error: str = ""


class SlowReaderRecord(msgspec.Struct):
    """--slow-reader: a connection that sent appends to one daemon and never read a reply."""

    daemon: int
    supervisor_pid: int
    session_id: str
    rows_per_append: int
    reply_bytes_each: int
    appends_planned: int
    appends_sent: int = 0  # whole request frames the daemon's socket accepted
    send_blocked: bool = False  # the socket stopped accepting: the daemon stopped reading
    appends_processed: int = 0  # appends the daemon executed for the connection (the session's length / rows)
    rss_before_bytes: int = 0
    rss_max_bytes: int = 0
    rss_after_bytes: int = 0
    bound_bytes: int = 0
    closed: bool = False
    released: bool = False
    detail: str = ""


class ReplanRecord(msgspec.Struct):
    """One session's re-plan (--replan): onto which chain, at what length, and what it did."""

    session_id: str
    onto: str  # "second chain (P shards)" or "first chain (P shards)"
    length: int  # the session's length when it moved
    seconds: float  # Router.replan's time for this session (export, re-slice, import, release)
    outcome: str  # moved, failed (replays on the new route) or nothing_held (length 0: nothing to move)
    moved_bytes: int = 0
    failure: str = ""


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
    warnings: list[str] = msgspec.field(default_factory=list)  # what the run could not exercise (never a failure)
    stalls: list[StallRecord] = msgspec.field(default_factory=list)
    supervisor_kills: list[SupervisorKillRecord] = msgspec.field(default_factory=list)
    slow_reader: SlowReaderRecord | None = None
    restarts: list[RestartRecord] = msgspec.field(default_factory=list)
    replans: list[ReplanRecord] = msgspec.field(default_factory=list)


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
    lines += ["", f"{'SESSION':<22} {'OPS':>4} {'APPENDS':>7} {'RESETS':>6} {'RECOV':>5} {'EPOCH':>5} {'LEN':>4} {'ROWS=':>5} {'GREEDY=':>7} {'DONE s':>7} {'MAXWAIT s':>9}  RESULT"]
    for s in report.sessions:
        result = "exact" if not s.mismatches and not s.violations and s.final_logits_max_abs_diff == 0.0 else "FAIL"
        done = f"{s.completed_s:.1f}" if s.completed_s is not None else "-"
        lines.append(
            f"{s.session_id[-22:]:<22} {sum(s.ops.values()):>4} {s.appends:>7} {s.resets:>6} {s.recoveries:>5} {s.final_epoch:>5} "
            f"{s.final_length:>4} {s.checked_rows:>5} {s.greedy_checked:>7} {done:>7} {s.max_admission_wait_s:>9.2f}  {result}"
        )
    if report.options.get("restart") or report.options.get("persist_after_s") is not None:
        lines += _recovery_lines(report)
    lines += ["", f"{'DAEMON':<7} {'LAYERS':<9} {'LIMIT':>10} {'PEAK RES':>10} {'RES AFTER':>10} {'EVICT':>5} {'EXPIRE':>6} {'RESTART':>7} {'CANCEL':>6}  WORKER USS max |delta|"]
    for index, d in enumerate(report.daemons):
        worst = max((abs(w.delta_bytes) for w in d.workers), default=0)
        lines.append(
            f"{str(index) + ('*' if d.restarted else ''):<7} {d.layers:<9} {format_bytes(d.limit_bytes):>10} {format_bytes(d.peak_reserved_bytes):>10} {format_bytes(d.reserved_after):>10} "
            f"{d.counters.get('evictions', 0):>5} {d.counters.get('expirations', 0):>6} {d.counters.get('worker_restarts', 0):>7} "
            f"{d.counters.get('cancels', 0):>6}  {format_bytes(worst)} (tolerance {format_bytes(report.uss_tolerance_bytes)})"
        )
    if any(d.restarted for d in report.daemons):
        lines.append("* restarted during the run (--kill-supervisor, --restart): its counters are since the restart")
    if report.options.get("shared_prefix"):
        lines += _prefix_lines(report)
    if report.replans:
        lines += ["", f"{'RE-PLAN':<22} {'ONTO':<26} {'LEN':>4} {'OUTCOME':<12} {'BYTES':>10} {'ms':>8}"]
        for r in report.replans:
            lines.append(f"{r.session_id[-22:]:<22} {r.onto:<26} {r.length:>4} {r.outcome:<12} {format_bytes(r.moved_bytes):>10} {r.seconds * 1000:>8.1f}")
    lines += ["", "VERDICTS"]
    for verdict in report.verdicts:
        lines.append(f"  {'PASS' if verdict.passed else 'FAIL'}  {verdict.name:<22} {verdict.detail}")
    if report.warnings:
        lines += ["", "WARNINGS (not exercised in this run; not a failure)"]
        lines += [f"  WARNING  {warning}" for warning in report.warnings]
    lines += ["", f"RESULT: {'PASS' if report.passed else 'FAIL'}"]
    return "\n".join(lines)


def _recovery_lines(report: StressReport) -> list[str]:
    """--restart and --persist-after: what recovery cost each session, and each restart."""
    lines = ["", f"{'SESSION':<22} {'FULL':>4} {'TOKENS':>6} {'TAIL':>4} {'TOKENS':>6} {'MISMATCH':>8} {'RESTORED':>8} {'LOST CONN':>9}"]
    for s in report.sessions:
        lines.append(f"{s.session_id[-22:]:<22} {s.full_replays:>4} {s.full_replayed_tokens:>6} {s.tail_replays:>4} {s.tail_replayed_tokens:>6} "
                     f"{s.position_mismatches:>8} {s.restores:>8} {s.connection_losses:>9}")
    lines.append(f"{'total':<22} {sum(s.full_replays for s in report.sessions):>4} {sum(s.full_replayed_tokens for s in report.sessions):>6} "
                 f"{sum(s.tail_replays for s in report.sessions):>4} {sum(s.tail_replayed_tokens for s in report.sessions):>6} "
                 f"{sum(s.position_mismatches for s in report.sessions):>8} {sum(s.restores for s in report.sessions):>8} {sum(s.connection_losses for s in report.sessions):>9}")
    for r in report.restarts:
        lines.append(f"restart of daemon {r.daemon} at op {r.at_ops}: drained in {r.drain_s:.2f} s (exit {r.exit_code}), successor answered in {r.restart_s:.2f} s, "
                     f"{len(r.adopted)} sessions still parked then; {r.drain_line or 'no drain line'}; {r.adoption_line or 'no adoption line'}")
    for k in report.supervisor_kills:
        if k.victim_copy is not None or k.adopted:
            copy = f"{k.session_id}'s copy at length {k.victim_copy.length}" if k.victim_copy is not None else "no copy of the killed session"
            lines.append(f"kill of daemon {k.daemon}: {copy} (idle wait {k.copy_wait_s:.2f} s); restarted in {k.restart_s:.2f} s; adopted "
                         + (", ".join(f"{a.session_id[-8:]}@{a.length}" for a in k.adopted) or "nothing") + f"; {k.adoption_line or 'no adoption line'}")
    return lines


def _prefix_lines(report: StressReport) -> list[str]:
    """--shared-prefix: each session's prompt and what the router reused for it, then each daemon's prefix counters and store."""
    options = report.options
    lines = ["", f"SHARED PREFIXES (--prefix-block {options['prefix_block']}, --prefix-cache-budget {format_bytes(int(options['prefix_cache_bytes']))} per daemon)",
             f"{'SESSION':<22} {'PROMPT':>6} {'SHARES':>6} {'HITS':>4} {'TOKENS':>6} {'FALLBK':>6}  {'KIND':<24} REUSED AT EACH FRESH START"]
    for s in report.sessions:
        starts = " ".join(str(tokens) for tokens in s.prefix_starts) or "-"
        lines.append(f"{s.session_id[-22:]:<22} {s.prompt_tokens:>6} {s.shared_tokens:>6} {s.prefix_hits:>4} {s.prefix_hit_tokens:>6} {s.prefix_fallbacks:>6}  {s.prompt_kind:<24} {starts}")
    lines.append(f"{'router total':<22} {'':>6} {'':>6} {sum(s.prefix_hits for s in report.sessions):>4} {sum(s.prefix_hit_tokens for s in report.sessions):>6} "
                 f"{sum(s.prefix_fallbacks for s in report.sessions):>6}")
    lines += ["", f"{'DAEMON':<7} {'HITS':>5} {'TOKENS':>6} {'MISSES':>6} {'STORED':>6} {'EVICT':>5} {'LOOKUPS':>7} {'PARKED':>6} {'RESTORED':>8}  STORE AT THE END"]
    for index, d in enumerate(report.daemons):
        c = d.counters
        store = d.prefix_store
        held = (f"{store.entries} entries, {store.blocks} blocks, {format_bytes(store.bytes)} of {format_bytes(store.limit_bytes)}" if store is not None else "no prefix store")
        lines.append(f"{index:<7} {c.get('prefix_hits', 0):>5} {c.get('prefix_hit_tokens', 0):>6} {c.get('prefix_misses', 0):>6} {c.get('prefix_stored', 0):>6} "
                     f"{c.get('prefix_evictions', 0):>5} {c.get('prefix_lookups', 0):>7} {c.get('spills', 0):>6} {c.get('restores', 0):>8}  {held}")
    return lines

"""Verdicts of the operations and of the fault drills (kill worker, kill supervisor, with --persist-after
only tail replays, the rolling restart, stall worker, slow reader, nothing left over). A drill that ran and went wrong fails; what timing did not let the run
exercise is a warning."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.host import format_bytes
from kvpool.stress.options import FORCED_KINDS, OpKind, StressOptions
from kvpool.stress.processes import ORPHAN_HANG_GUARD_S
from kvpool.stress.report import DaemonSummary, RestartRecord, Sample, SessionSummary, SlowReaderRecord, StallRecord, SupervisorKillRecord, Verdict

if TYPE_CHECKING:
    from kvpool.stress.driver import SessionDriver


def operations_verdict(options: StressOptions, sessions: Sequence[SessionSummary], n_stages: int) -> tuple[Verdict, list[str]]:
    """Fails only when an operation ran and the daemons answered it wrongly; lists what was not exercised."""
    done: Counter[str] = Counter()
    for summary in sessions:
        done.update(summary.ops)
    wanted = [str(kind) for kind in FORCED_KINDS] + [str(OpKind.PREFILL), str(OpKind.DECODE)] + ([str(OpKind.IDLE)] if options.ttl_s is not None else [])
    landed: Counter[int] = Counter()
    for summary in sessions:
        landed.update({int(stage): count for stage, count in summary.cancels_landed_on.items()})
    late = sum(s.late_cancels for s in sessions)
    missed_attempts = sum(s.cancel_attempts_missed for s in sessions)
    closing_decodes = sum(s.greedy_checked for s in sessions)  # every session ends with greedy decodes
    warnings = [f"operation {kind} never exercised" for kind in wanted if not done[kind] and not (kind == OpKind.DECODE and closing_decodes)]
    if not late:
        warnings.append("no cancel after completion was exercised (every one was cut short by lost state)")
    for stage in range(n_stages):
        if not landed[stage]:
            warnings.append(f"no cancel landed mid-prefill on daemon {stage}: every attempt aimed there lost the session's state first (eviction, expiry) "
                            f"or completed before a cancel landed ({missed_attempts} attempts in the run completed first)")
    failed = [f"{s.session_id}: {s.failed_op}" for s in sessions if s.failed_op]
    summary = (
        ", ".join(f"{k} {done[k]}" for k in wanted)
        + f"; cancels landed mid-prefill per daemon {[landed[stage] for stage in range(n_stages)]}, after completion (checked on every daemon) {late}"
        + (f", attempts that completed first and were retried {missed_attempts}" if missed_attempts else "")
    )
    if failed:
        return Verdict("operations", False, "behaved wrongly during: " + "; ".join(failed) + " (see contract)"), warnings
    return Verdict("operations", True, summary + (f"; {len(warnings)} not exercised (warnings)" if warnings else "")), warnings


def leftovers_verdict(pids: Sequence[int], segments: Sequence[str]) -> Verdict:
    passed = not pids and not segments
    return Verdict("no_leftovers", passed, "every process of the daemons (workers, replacements, a killed supervisor's) gone after its daemon's end; no /dev/shm segment of theirs left"
                   if passed else f"still alive at the hang guard ({ORPHAN_HANG_GUARD_S:g} s): {list(pids)} (killed now); segments left: {list(segments)} (unlinked now)")


def kill_worker_verdict(drivers: Sequence[SessionDriver], sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], workers_expected: int | None, exact: bool) -> Verdict:
    kills = [driver.faults.kill for driver in drivers if driver.faults.kill is not None]
    if not kills:
        return Verdict("kill_worker", False, "the planned kill never happened (the session never decoded while live)")
    kill = kills[0]
    victim = next(d for d in drivers if d.faults.kill is kill)
    daemon = daemons[kill.daemon]
    replaced = kill.pid not in {w.pid for w in daemon.workers} and (workers_expected is None or len(daemon.workers) == workers_expected)
    others = [s for s in sessions if s.session_id != victim.session_id]
    others_exact = all(not s.mismatches and not s.violations for s in others)
    reported = kill.reply in ("worker_lost", "cache_miss/worker_lost")
    passed = reported and replaced and others_exact and exact and daemon.counters.get("worker_restarts", 0) >= 1
    return Verdict("kill_worker", passed, f"SIGKILL pid {kill.pid} (daemon {kill.daemon}, {kill.session_id} at length {kill.length}): answered {kill.reply}; "
                   f"replayed from 0 at epoch {victim.epoch}; worker replaced: {replaced}; other sessions exact: {others_exact} "
                   f"(their recoveries: {sum(s.recoveries for s in others)})")


def kill_supervisor_verdict(kills: Sequence[SupervisorKillRecord], sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], samples: Sequence[Sample], exact: bool,
                            persist_after_s: float | None = None) -> Verdict:
    if not kills:
        return Verdict("kill_supervisor", False, "the planned supervisor kill never happened")
    kill = kills[0]
    orphans_ok = not kill.orphans_at_deadline and kill.all_gone_s is not None
    segments_ok = not kill.segments_left
    restarted = kill.new_pid > 0 and not kill.restart_error
    lost = [s for s in sessions if s.connection_losses]
    victim = next((s for s in sessions if s.session_id == kill.session_id), None)
    if persist_after_s is not None:
        recovered, recovery = _tail_recovered(kill, sessions, victim)
    else:
        # The killed daemon's sessions are gone with it: the session it was killed under must have replayed at a new
        # epoch, however it learnt of the loss (a lost connection, or a cache miss on the restarted daemon); so must
        # every session that lost a connection while it ran. One lost only at its final release is released again.
        recovered = (victim is not None and victim.recoveries >= 1 and victim.final_epoch >= 2 and not victim.violations
                     and all(s.recoveries >= 1 and s.final_epoch >= 2 and not s.violations for s in lost))
        recovery = f"the killed session and those replayed from 0 at a new epoch: {recovered}"
    released_again = sum(s.release_reconnects for s in sessions)
    survivors = [i for i in range(len(daemons)) if i != kill.daemon]
    books = all(daemons[i].integrity_after == "ok" for i in survivors) and all(s.integrity == "ok" for s in samples if s.daemon in survivors)
    passed = orphans_ok and segments_ok and restarted and recovered and books and exact
    gone = (f"all {len(kill.descendants)} gone in {kill.all_gone_s:g} s" if kill.all_gone_s is not None
            else f"still alive at the hang guard ({ORPHAN_HANG_GUARD_S:g} s): {kill.orphans_at_deadline}")
    return Verdict("kill_supervisor", passed,
                   f"SIGKILL supervisor pid {kill.pid} of daemon {kill.daemon} ({kill.session_id}, op {kill.op_index}): its processes {kill.descendants} {gone}; "
                   f"its {len(kill.segments)} /dev/shm segments " + ("all removed" if segments_ok else f"left: {kill.segments_left}")
                   + (f"; restarted on the same socket by {kill.restarted_by} in {kill.restart_s:g} s (pid {kill.new_pid})" if restarted else f"; restart failed: {kill.restart_error or 'never restarted'}")
                   + f"; {len(lost)} sessions got ConnectionLost while running, {released_again} at their final release (released again); "
                   f"{recovery}; books of daemons {survivors} balanced at every sample and after: {books}; every session exact: {exact}")


def _tail_recovered(kill: SupervisorKillRecord, sessions: Sequence[SessionSummary], victim: SessionSummary | None) -> tuple[bool, str]:
    """--persist-after: the restarted daemon adopted the killed session's copy, and no session whose state it
    adopted replayed from 0 (the router replayed only the tail since each copy); the others may (cache_miss)."""
    adopted = {state.session_id for state in kill.adopted}
    full = [s.session_id for s in sessions if s.session_id in adopted and s.full_replays]
    victim_adopted = victim is not None and kill.victim_copy is not None and victim.session_id in adopted
    passed = victim_adopted and not full and not any(s.violations for s in sessions)
    tails = sum(s.tail_replays for s in sessions)
    tokens = sum(s.tail_replayed_tokens for s in sessions)
    others = [s for s in sessions if s.session_id not in adopted]
    copy = f"at length {kill.victim_copy.length} (it waited {kill.copy_wait_s:g} s idle for it)" if kill.victim_copy is not None else "none"
    return passed, (f"the killed session's copy {copy}, adopted: {victim_adopted}; {len(adopted)} sessions adopted "
                    f"({', '.join(f'{a.session_id[-8:]}@{a.length}' for a in kill.adopted) or 'none'}), full replays among them {len(full)}{' ' + str(full) if full else ''}; "
                    f"tail replays {tails} of {tokens} tokens in all (victim: {victim.tail_replays if victim else 0} of {victim.tail_replayed_tokens if victim else 0}); "
                    f"sessions without a copy replayed from 0: {sum(s.full_replays for s in others)} times")


def restart_verdict(restarts: Sequence[RestartRecord], error: str, sessions: Sequence[SessionSummary], n_stages: int, exact: bool) -> Verdict:
    """--restart: every daemon of the route drained once (exit 0, nothing of it left) and followed by a daemon on
    its socket and spill dir; no session replayed from 0 (their states were parked and adopted); the appends
    after a drain answered restored: true; every session exact."""
    each_once = sorted(r.daemon for r in restarts) == list(range(n_stages))
    drained = all(r.exit_code == 0 and not r.left_alive and r.new_pid and not r.restart_error for r in restarts)
    full = sum(s.full_replays for s in sessions)
    restores = sum(s.restores for s in sessions)
    passed = each_once and drained and not error and full == 0 and restores > 0 and exact
    steps = "; ".join(
        f"daemon {r.daemon} at op {r.at_ops}: drained in {r.drain_s:g} s (exit {r.exit_code}"
        + (f", still alive at the hang guard ({ORPHAN_HANG_GUARD_S:g} s): {r.left_alive}" if r.left_alive else f", its processes gone {r.workers_gone_s:g} s after")
        + f"), successor answered in {r.restart_s:g} s"
        + (f" ({r.adoption_line})" if r.adoption_line else "") + (f", start failed: {r.restart_error[:300]}" if r.restart_error else "")
        for r in restarts
    ) or "no daemon was drained"
    missing = sorted(set(range(n_stages)) - {r.daemon for r in restarts})
    return Verdict("rolling_restart", passed,
                   f"{steps}" + (f"; never drained: daemons {missing}" if missing else "") + (f"; stopped: {error[:300]}" if error else "")
                   + f"; appends answered restored: true {restores}; full replays {full} ({sum(s.full_replayed_tokens for s in sessions)} tokens); "
                   f"tail replays {sum(s.tail_replays for s in sessions)} ({sum(s.tail_replayed_tokens for s in sessions)} tokens); "
                   f"lost connections {sum(s.connection_losses for s in sessions)}; every session exact: {exact}")


def stall_worker_verdict(stalls: Sequence[StallRecord], sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], workers_expected: int | None, exact: bool) -> Verdict:
    if not stalls:
        return Verdict("stall_worker", False, "the planned stall never happened (the session never decoded while live)")
    stall = stalls[0]
    daemon = daemons[stall.daemon]
    # through the supervisor the append in flight is answered worker_lost; on a direct channel the worker's
    # end closes the channel and the daemon answers the client's retry: cache_miss/worker_lost
    typed = stall.reply in ("worker_lost", "cache_miss/worker_lost") and not stall.continued_by_driver
    timed = stall.elapsed_s >= stall.timeout_s - 0.05  # never before the timeout (the lower bound does not depend on speed)
    replaced = stall.pid not in {w.pid for w in daemon.workers} and (workers_expected is None or len(daemon.workers) == workers_expected)
    passed = typed and timed and stall.worker_gone and replaced and not stall.left_stopped and exact
    return Verdict("stall_worker", passed,
                   f"SIGSTOP pid {stall.pid} (daemon {stall.daemon}, --request-timeout {stall.timeout_s:g} s, {stall.session_id} at length {stall.length}): the append answered "
                   f"{stall.reply or 'nothing'} after {stall.elapsed_s:g} s" + (" (only after the driver's SIGCONT: a hang)" if stall.continued_by_driver else "")
                   + f"; stopped worker gone: {stall.worker_gone}; replaced: {replaced}; left stopped at the end: {stall.left_stopped}; every session exact: {exact}")


def slow_reader_verdict(record: SlowReaderRecord | None, exact: bool) -> tuple[Verdict, list[str]]:
    if record is None:
        return Verdict("slow_reader", False, "the slow reader never started"), []
    growth = record.rss_max_bytes - record.rss_before_bytes
    unread = record.appends_sent * record.reply_bytes_each
    passed = growth <= record.bound_bytes and record.closed and record.released and not record.detail and exact
    warnings = []
    if record.appends_planned * record.reply_bytes_each < 2 * record.bound_bytes:
        warnings.append(f"slow reader: all its replies together ({format_bytes(record.appends_planned * record.reply_bytes_each)}) are less than twice the RSS bound: the drill cannot tell a bound from none")
    detail = (
        f"{record.appends_sent} of {record.appends_planned} appends of {record.rows_per_append} rows sent to daemon {record.daemon} on one connection that never read "
        f"(replies of {format_bytes(record.reply_bytes_each)} each; the socket {'stopped accepting' if record.send_blocked else 'accepted them all'}); "
        f"the daemon executed {record.appends_processed} of them; supervisor RSS {format_bytes(record.rss_before_bytes)} -> max {format_bytes(record.rss_max_bytes)} "
        f"(+{format_bytes(max(growth, 0))}, bound {format_bytes(record.bound_bytes)}; replies of the appends sent {format_bytes(unread)}, "
        f"of all {record.appends_planned} {format_bytes(record.appends_planned * record.reply_bytes_each)}); "
        f"closed: {record.closed}; session released: {record.released}; every other session exact: {exact}" + (f"; {record.detail}" if record.detail else "")
    )
    return Verdict("slow_reader", passed, detail), warnings


def progress_verdict(options: StressOptions, sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], exact: bool) -> Verdict:
    """Overload (more sessions than places): every session finished all its operations, exactly. The waits
    are shown: each admission waited in its daemon's line behind at most the admissions that came before it
    (kvpool.daemon.admission.queue), so no session waits on a later one."""
    done = [s for s in sessions if s.completed_s is not None]
    waits = sorted(sessions, key=lambda s: s.max_admission_wait_s)
    longest = waits[-1] if waits else None
    queued = [d.counters.get("admissions_queued", 0) for d in daemons]
    rejects = [d.counters.get("over_budget_rejects", 0) for d in daemons]
    line_max = [d.counters.get("admission_wait_max_ms", 0) for d in daemons]
    passed = len(done) == len(sessions) and exact
    finished = f"{len(done)}/{len(sessions)} sessions finished all {options.ops} operations and their closing decodes"
    if done:
        finished += f" (first at {min(s.completed_s for s in done):.1f} s, last at {max(s.completed_s for s in done):.1f} s)"
    detail = (f"{finished}; longest admission wait {longest.max_admission_wait_s:.2f} s ({longest.session_id})" if longest else finished)
    detail += f"; admissions that waited in line per daemon {queued} (longest {line_max} ms), over_budget replies per daemon {rejects}"
    return Verdict("progress", passed, detail)


def replan_verdict(drivers: Sequence[SessionDriver], second_chain: Sequence[DaemonSummary], exact: bool) -> tuple[Verdict, list[str]]:
    """--replan: every re-plan of a session holding tokens moved it (no failure, no replay), the sessions
    are exact, and the second chain holds nothing of the run at the end, its books balanced."""
    records = [record for driver in drivers if driver.replans is not None for record in driver.replans.records]
    planned = sum(len(driver.replans.points) for driver in drivers if driver.replans is not None)
    outcomes = Counter(record.outcome for record in records)
    replays = sum(driver.session.counts.replays for driver in drivers)
    moved_bytes = sum(record.moved_bytes for record in records)
    left = [(index, d.our_sessions_after, d.integrity_after) for index, d in enumerate(second_chain) if d.our_sessions_after or d.integrity_after != "ok"]
    failures = [f"{record.session_id} onto the {record.onto} at length {record.length}: {record.failure}" for record in records if record.outcome == "failed"]
    warnings = [f"{outcomes['nothing_held']} re-plans found the session holding nothing (just released): nothing to move"] if outcomes["nothing_held"] else []
    passed = len(records) == planned and not failures and outcomes["moved"] > 0 and replays == 0 and not left and exact
    seconds = sorted(record.seconds for record in records if record.outcome == "moved")
    median = f", {seconds[len(seconds) // 2] * 1000:.0f} ms median, {seconds[-1] * 1000:.0f} ms max per session" if seconds else ""
    detail = (
        f"{len(records)}/{planned} re-plans: moved {outcomes['moved']} ({format_bytes(moved_bytes)} imported{median}), "
        f"failed {outcomes['failed']}, nothing held {outcomes['nothing_held']}; replays {replays}; " + ("all exact" if exact else "NOT exact (see exact)")
    )
    if failures:
        detail += "; " + "; ".join(failures)[:1500]
    if left:
        detail += f"; the second chain holds sessions of the run at the end or its books do not balance: {left}"
    return Verdict("replan", passed, detail), warnings


def shared_prefix_verdict(sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], exact: bool) -> tuple[Verdict, list[str]]:
    """--shared-prefix: some session started from a stored prefix (a run with no hit at all fails), every daemon
    admitted at least what the router reused (each router hit is an admission on every daemon of the route),
    and every session is exact. Which hits timing allowed (another session's prefix on a first start, an
    eviction from the prefix store, a park) is reported; one it did not is a warning."""
    hits = sum(s.prefix_hits for s in sessions)
    tokens = sum(s.prefix_hit_tokens for s in sessions)
    fallbacks = sum(s.prefix_fallbacks for s in sessions)
    counters = {name: [d.counters.get(name, 0) for d in daemons] for name in ("prefix_hits", "prefix_hit_tokens", "prefix_misses", "prefix_stored", "prefix_evictions", "spills")}
    admitted = all(h >= hits and t >= tokens for h, t in zip(counters["prefix_hits"], counters["prefix_hit_tokens"]))
    first = [s for s in sessions if s.prefix_starts and s.prefix_starts[0] > 0]  # nothing of its own was stored yet
    starts = sum(len(s.prefix_starts) for s in sessions)
    warnings = []
    if not any(counters["prefix_evictions"]):
        warnings.append("shared prefixes: no daemon's prefix store evicted an entry (its --prefix-cache-budget held every prefix offered)")
    if not first:
        warnings.append("shared prefixes: no session's first start reused a prefix another session stored (every hit was of a session's own earlier start)")
    if not any(counters["spills"]):
        warnings.append("shared prefixes: no session was parked (evicted into the warm tier) during the run")
    passed = hits > 0 and admitted and exact
    detail = (
        f"router: {hits} starts from a stored prefix ({tokens} positions not computed) in {starts} fresh starts, {fallbacks} fallbacks; "
        f"{len(first)} first starts reused another session's prefix; per daemon prefix_hits {counters['prefix_hits']}, prefix_hit_tokens {counters['prefix_hit_tokens']}, "
        f"prefix_misses {counters['prefix_misses']}, prefix_stored {counters['prefix_stored']}, prefix_evictions {counters['prefix_evictions']}, parked {counters['spills']}; "
        + ("every daemon admitted what the router reused" if admitted else "a daemon admitted fewer prefixes than the router reused")
        + ("; all exact" if exact else "; NOT exact (see exact)")
    )
    if not hits:
        detail = "no session started from a stored prefix: " + detail
    return Verdict("shared_prefix", passed, detail), warnings

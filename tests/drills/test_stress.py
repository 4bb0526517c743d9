"""The four-session stress run and its fault drills, bounded for CI: a regression in isolation fails here.

Each test is one `kvpool stress` run in process (kvpool.stress.run_stress): a chain of three daemons on
the bundled model, four sessions x 40 operations (16 for the newer drills), then every session replayed
alone in process (--reference local: kvpool.local.chain.LocalChain, which the daemons equal bit for bit);
the default drill replays on a fresh chain of daemons (the CLI's default, --reference daemon) so that
reference is exercised too. Every run is bounded by operations; the timeouts are hang guards only, far above
what the slowest, busiest machine needs. No assertion depends on speed: what timing decides (whether a
cancel lands mid-prefill) is at most a warning in the report.
"""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest

from kvpool.client.client import AppendResult, Client, ConnectionLost, KvpoolError
from kvpool.router.recovery import RecoveryPolicy
from kvpool.router.route import StageFailed
from kvpool.router.session import RoutedSession
from kvpool.shard.cache import shards_in_parts
from kvpool.stress.drill_checks import kill_supervisor_verdict, operations_verdict, restart_verdict, shared_prefix_verdict
from kvpool.stress.log import LocalReference, LoggedAppend, LoggedReset, LoggedTruncate, replay_alone, row_digest
from kvpool.stress.options import LATE_CANCEL, FaultKind, OpKind, StressOptions
from kvpool.stress.plans import build_plans, cancel_targets
from kvpool.stress.prefixes import prefill_rows, shared_prompts
from kvpool.stress.report import DaemonSummary, RestartRecord, SavedState, SessionSummary, StressReport, SupervisorKillRecord
from kvpool.stress.runner import run_stress
from kvpool.wire.protocol import ErrorCode, ErrorReply
from tests.conftest import EVEN_SPLIT

SESSIONS = 4
OPS = 40
DRILL_OPS = 16
OVERLOAD_SESSIONS = 8
OVERLOAD_OPS = 12
HANG_GUARD_S = 1200
DURABLE_SESSIONS = 2  # --restart, --persist-after: small runs (each restart starts a daemon)
DURABLE_OPS = 12
# --stall-timeout of the stalled worker's daemon (the CLI's default is 30 s). It bounds that daemon's every
# worker call: the longest is one chunk of a session's prefill (at most 192 rows on a 10-layer shard at n_ctx
# 512: ~0.4 s idle on a 2-core EPYC, ~1.2 s beside two CPU burners) or, if the suite's calibration cache has no
# reading yet, the start-up probe's 512-row batch (~1.1 s idle). The drill waits this long for the stall.
STALL_TIMEOUT_S = 12.0
COMMON_VERDICTS = {"contract", "exact", "operations", "books_at_every_sample", "released", "worker_memory"}


def _run(tmp_path: pathlib.Path, **overrides) -> StressReport:
    json_path = tmp_path / "stress.json"
    report = run_stress(StressOptions(**{"sessions": SESSIONS, "ops": OPS, "json_path": json_path, "reference": "local"} | overrides))
    failed = [f"{v.name}: {v.detail}" for v in report.verdicts if not v.passed]
    assert report.passed and not failed, failed
    # the --json document is the same report
    assert msgspec.json.decode(json_path.read_bytes(), type=StressReport).verdicts == report.verdicts
    return report


def _verdict(report: StressReport, name: str):
    return next(verdict for verdict in report.verdicts if verdict.name == name)


def _assert_common(report: StressReport) -> None:
    assert COMMON_VERDICTS <= {verdict.name for verdict in report.verdicts}
    assert len(report.sessions) == report.options["sessions"]
    for session in report.sessions:
        assert session.checked_rows > 0 and session.greedy_checked > 0
        assert session.final_logits_max_abs_diff == 0.0 and not session.mismatches and not session.violations
        assert len(session.generated) >= report.options["final_tokens"]
    assert all(d.our_sessions_after == 0 and d.reserved_after == d.reserved_before == 0 for d in report.daemons)
    assert all(d.integrity_after == "ok" for d in report.daemons)
    assert all(w.within_tolerance for d in report.daemons for w in d.workers)
    assert report.samples and all(s.reserved_bytes <= s.limit_bytes for s in report.samples)
    assert {"stale_epoch", "cache_miss/new_epoch"} <= set(report.errors_by_code)  # the forced drills
    assert all(d.counters["peak_concurrent_compute_threads"] == 1 for d in report.daemons)  # --threads 1 each
    assert _verdict(report, "no_leftovers").passed  # no process or /dev/shm segment outlived the daemons
    # every forced operation ran; a cancel after completion is checked on every daemon unless state was lost
    assert all(not session.unexercised and not session.failed_op for session in report.sessions)


@pytest.mark.timeout(HANG_GUARD_S)
def test_default_four_sessions_equal_each_alone(tmp_path):
    report = _run(tmp_path, reference="daemon")
    _assert_common(report)
    assert report.scenario == "default" and report.reference == "fresh daemons"
    for kind in ("prefill", "decode", "truncate", "cancel", "release_reopen", "epoch_bump", "stale_epoch"):
        assert report.ops_by_kind[kind] > 0 and report.latency_ms[kind].count > 0
    # nothing but the drills' own expected replies: no eviction, expiry or lost worker without a fault
    assert set(report.errors_by_code) <= {"stale_epoch", "cache_miss/new_epoch", "cancelled"}
    assert sum(session.recoveries for session in report.sessions) == 0
    # without eviction or expiry the late cancel is deterministic: every daemon answered "nothing in flight"
    assert sum(session.late_cancels for session in report.sessions) >= 1
    assert not [w for w in report.warnings if "after completion" in w]


@pytest.mark.timeout(HANG_GUARD_S)
def test_budget_for_two_of_four_evicts_lru_and_evicted_sessions_replay_exactly(tmp_path):
    # plain LRU: no residency spares anyone; DRILL_OPS, as the newer drills: 4 sessions on 2 places evict from the
    # third admission on, and each eviction's replay is checked (40 operations took 118 s beside two burners)
    report = _run(tmp_path, budget_for=2, ops=DRILL_OPS, seed=1, min_residency_s=0)
    _assert_common(report)
    assert _verdict(report, "lru_eviction").passed
    assert report.errors_by_code.get("cache_miss/evicted", 0) > 0
    assert sum(session.misses.get("evicted", 0) for session in report.sessions) > 0
    for daemon in report.daemons:
        assert 2 * daemon.session_charge_bytes <= daemon.limit_bytes < 3 * daemon.session_charge_bytes
        assert daemon.peak_reserved_bytes <= daemon.limit_bytes
    assert sum(daemon.counters["evictions"] for daemon in report.daemons) > 0


@pytest.mark.timeout(HANG_GUARD_S)
def test_eight_sessions_on_two_places_every_one_finishes_exactly_waiting_in_line_not_spinning(tmp_path):
    """Issue 13: a budget for 2 sessions on each daemon, 8 sessions active. With plain LRU a session was
    evicted from one daemon while its token was still on the next, every session replayed again and again,
    and the closing decodes made no progress (thousands of over_budget replies). Residency keeps a session
    that just appended; admissions wait in each daemon's line, first come first served."""
    report = _run(tmp_path, budget_for=2, sessions=OVERLOAD_SESSIONS, ops=OVERLOAD_OPS, seed=7)
    _assert_common(report)
    assert _verdict(report, "progress").passed and _verdict(report, "lru_eviction").passed
    assert all(session.completed_s is not None and session.admissions >= 1 for session in report.sessions)
    assert sum(daemon.counters["admissions_queued"] for daemon in report.daemons) > 0  # more sessions than places: some waited
    assert max(session.max_admission_wait_s for session in report.sessions) > 0
    assert all(daemon.counters["min_residency_ms"] > 0 for daemon in report.daemons)
    assert report.errors_by_code.get("over_budget", 0) <= OVERLOAD_SESSIONS  # a wait in line, not a storm of refusals
    for daemon in report.daemons:
        assert daemon.peak_reserved_bytes <= daemon.limit_bytes < 3 * daemon.session_charge_bytes


@pytest.mark.timeout(HANG_GUARD_S)
def test_spill_four_sessions_on_two_places_park_and_restore_without_a_cache_miss(tmp_path):
    report = _run(tmp_path, spill=True, ops=DRILL_OPS, seed=3)  # plain LRU on every daemon (kvpool.stress.daemons.serve_options)
    _assert_common(report)
    assert report.scenario == "spill" and _verdict(report, "warm_tier").passed
    assert sum(sum(session.misses.values()) for session in report.sessions) == 0
    assert sum(session.recoveries for session in report.sessions) == 0
    assert all(daemon.counters["restores"] > 0 and daemon.counters["spills"] >= daemon.counters["restores"] for daemon in report.daemons)
    assert not {code for code in report.errors_by_code if code.startswith("cache_miss/")} - {"cache_miss/new_epoch"}


@pytest.mark.timeout(HANG_GUARD_S)
def test_ttl_one_second_expires_idle_sessions(tmp_path):
    # DRILL_OPS: every session still idles once past the TTL (a forced operation); 40 operations took 175 s beside
    # two burners, where any gap over 1 s between a session's operations expires it and costs a replay
    report = _run(tmp_path, ttl_s=1.0, ops=DRILL_OPS, seed=2)
    _assert_common(report)
    assert _verdict(report, "ttl_expiry").passed
    assert report.errors_by_code["cache_miss/expired"] >= SESSIONS  # every session idled once
    assert report.ops_by_kind["idle_expire"] == SESSIONS


@pytest.mark.timeout(HANG_GUARD_S)
def test_killed_worker_loses_one_session_which_replays_and_the_others_continue_exactly(tmp_path):
    report = _run(tmp_path, kill_worker=True, seed=3)
    _assert_common(report)
    assert _verdict(report, "kill_worker").passed
    [kill] = report.kills
    assert kill.reply in ("worker_lost", "cache_miss/worker_lost")
    daemon = report.daemons[kill.daemon]
    assert kill.pid not in {worker.pid for worker in daemon.workers} and daemon.counters["worker_restarts"] >= 1
    victim = next(session for session in report.sessions if session.session_id == kill.session_id)
    assert victim.recoveries >= 1 and victim.final_epoch > kill.epoch
    assert all(session.recoveries == 0 for session in report.sessions if session is not victim)


@pytest.mark.timeout(HANG_GUARD_S)
def test_killed_supervisor_leaves_nothing_is_restarted_and_every_session_replays_exactly(tmp_path):
    report = _run(tmp_path, kill_supervisor=True, seed=4, ops=DRILL_OPS)
    _assert_common(report)
    assert _verdict(report, "kill_supervisor").passed
    [kill] = report.supervisor_kills
    assert kill.descendants and not kill.orphans_at_deadline and kill.all_gone_s is not None  # all gone (waited for under the hang guard)
    assert kill.segments and not kill.segments_left  # its /dev/shm segments were removed
    assert kill.new_pid and kill.new_pid != kill.pid and not kill.restart_error
    assert report.daemons[kill.daemon].restarted
    assert all(not report.daemons[i].restarted and report.daemons[i].integrity_after == "ok" for i in range(3) if i != kill.daemon)
    lost = [session for session in report.sessions if session.connection_losses]
    [victim] = [session for session in report.sessions if session.session_id == kill.session_id]
    assert victim.recoveries >= 1 and victim.final_epoch >= 2  # its state died with the daemon: replayed at a new epoch
    assert all(session.recoveries >= 1 and session.final_epoch >= 2 for session in lost)
    assert any(session.connection_losses or session.release_reconnects for session in report.sessions)


@pytest.mark.timeout(HANG_GUARD_S)
def test_rolling_restart_drains_each_daemon_in_turn_and_no_session_replays_from_zero(tmp_path):
    """Issue 20: every daemon of the route drained (SIGTERM) in turn mid-run and a successor started on its
    socket and spill dir; the clients wait for it, the sessions' next appends are answered restored: true, no
    session replays from 0, and every session equals its run alone."""
    report = _run(tmp_path, restart=True, sessions=DURABLE_SESSIONS, ops=DURABLE_OPS, seed=1)
    _assert_common(report)
    assert report.scenario == "restart" and _verdict(report, "rolling_restart").passed
    assert sorted(r.daemon for r in report.restarts) == [0, 1, 2]
    assert all(r.exit_code == 0 and r.new_pid != r.pid and r.drain_line.startswith("drain done") and not r.left_alive for r in report.restarts)
    assert all(report.daemons[r.daemon].restarted for r in report.restarts)
    assert sum(s.full_replays for s in report.sessions) == 0 and sum(s.full_replayed_tokens for s in report.sessions) == 0
    assert sum(s.restores for s in report.sessions) >= 1
    assert not {code for code in report.errors_by_code if code.startswith("cache_miss/")} - {"cache_miss/new_epoch"}


@pytest.mark.timeout(HANG_GUARD_S)
def test_killed_supervisor_with_persist_after_costs_only_the_tail(tmp_path):
    """Issue 20: --persist-after with a disk tier. The killed session waits idle for its copy on the daemon
    about to be killed and is killed 2 decodes later; the daemon restarted on its socket and spill dir adopts
    every copy, and the router replays only the tail since each (same epoch): no adopted session replays from 0."""
    report = _run(tmp_path, kill_supervisor=True, persist_after_s=1.0, sessions=DURABLE_SESSIONS, ops=DURABLE_OPS, seed=4)
    _assert_common(report)
    assert report.scenario == "kill-supervisor+persist-after-1" and _verdict(report, "kill_supervisor").passed
    [kill] = report.supervisor_kills
    assert kill.victim_copy is not None and kill.victim_copy.session_id == kill.session_id
    assert kill.session_id in {state.session_id for state in kill.adopted} and kill.adoption_line.startswith("adopted ")
    [victim] = [s for s in report.sessions if s.session_id == kill.session_id]
    assert victim.full_replays == 0 and victim.full_replayed_tokens == 0  # its copy was adopted: nothing replayed from 0
    adopted = {state.session_id for state in kill.adopted}
    assert all(s.full_replays == 0 for s in report.sessions if s.session_id in adopted)


@pytest.mark.timeout(HANG_GUARD_S)
def test_stalled_worker_answers_worker_lost_after_the_request_timeout_and_is_replaced(tmp_path):
    report = _run(tmp_path, stall_worker=True, seed=5, ops=DRILL_OPS, stall_timeout_s=STALL_TIMEOUT_S)
    _assert_common(report)
    assert _verdict(report, "stall_worker").passed
    [stall] = report.stalls
    # a typed error, not a hang: worker_lost through the daemon; on the direct channel (the stalled append
    # usually goes there) the worker's end closes the channel and the daemon answers the retry cache_miss/worker_lost
    assert stall.reply in ("worker_lost", "cache_miss/worker_lost") and not stall.continued_by_driver
    assert stall.elapsed_s >= stall.timeout_s - 0.05  # and not before the timeout
    assert stall.worker_gone and not stall.left_stopped
    daemon = report.daemons[stall.daemon]
    assert stall.pid not in {worker.pid for worker in daemon.workers} and daemon.counters["worker_restarts"] >= 1
    victim = next(session for session in report.sessions if session.session_id == stall.session_id)
    assert victim.recoveries >= 1 and victim.final_epoch > stall.epoch
    assert all(session.recoveries == 0 for session in report.sessions if session is not victim)


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_connection_that_never_reads_keeps_the_daemon_bounded_and_the_others_exact(tmp_path):
    report = _run(tmp_path, slow_reader=True, seed=6, ops=DRILL_OPS)
    _assert_common(report)
    assert _verdict(report, "slow_reader").passed
    slow = report.slow_reader
    assert slow is not None and slow.appends_sent >= 1 and slow.send_blocked
    assert slow.rss_max_bytes - slow.rss_before_bytes <= slow.bound_bytes
    # backpressure: the daemon stopped executing the connection's appends, far short of all it was sent
    assert slow.appends_processed < slow.appends_sent
    assert slow.closed and slow.released


# ---- the drills themselves can fail ---------------------------------------------------------------------


UNDRAINED_SERVE = """
import sys
import kvpool.daemon.transport.frames as server

def replies_without_backpressure(writer):
    async def send(message):
        writer.write(server.encode(message))  # never waits for the buffer to drain
    return send

server._replies_to = replies_without_backpressure
from kvpool.cli.main import main
sys.exit(main())
"""


@pytest.mark.timeout(HANG_GUARD_S)
def test_slow_reader_drill_fails_against_a_daemon_without_backpressure(tmp_path, model_path):
    """Daemons whose transport never waits for its write buffer: the unread replies pile up in memory."""
    directory = pathlib.Path("/tmp") / f"kvpool-undrained-{os.getpid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    shards = [shard.path for shard in shards_in_parts(model_path, 3)]
    sockets = [directory / f"shard{index}.sock" for index in range(3)]
    processes = [
        subprocess.Popen([sys.executable, "-c", UNDRAINED_SERVE, "serve", "--model", str(shard), "--socket", str(path), "--threads", "1",
                          "--n-ctx", "512", "--max-sessions", "3", "--budget", "64GiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for shard, path in zip(shards, sockets)
    ]
    try:
        for path, process in zip(sockets, processes):
            _wait_serving(path, process)
        report = run_stress(StressOptions(sessions=1, ops=4, sockets=tuple(sockets), slow_reader=True, progress=False))
        slow = report.slow_reader
        assert not _verdict(report, "slow_reader").passed and not report.passed
        assert slow is not None and slow.rss_max_bytes - slow.rss_before_bytes > slow.bound_bytes
        assert slow.appends_sent == slow.appends_planned and not slow.send_blocked  # it kept reading...
        # ...and executing them, holding their replies (how many it executed before the drill's quiet period
        # ended depends on the machine's speed; the RSS growth above is the proof that replies piled up)
        assert 0 < slow.appends_processed <= slow.appends_sent
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_serving(path: pathlib.Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"daemon for {path} exited with {process.returncode}"
        if path.exists():
            try:
                Client(path, timeout_s=30).close()
                return
            except ConnectionLost:
                pass
        time.sleep(0.1)
    raise AssertionError(f"daemon for {path} never answered")


def _summary(session_id: str, **fields) -> SessionSummary:
    base = dict(session_id=session_id, prompt_tokens=10, ops={kind: 1 for kind in ("truncate", "cancel", "release_reopen", "epoch_bump", "stale_epoch", "prefill", "decode")},
                appends=1, resets=0, recoveries=0, misses={}, cancels_landed=3, cancels_completed=1, final_epoch=1, final_length=10, generated=[],
                checked_rows=1, greedy_checked=1, final_logits_max_abs_diff=0.0, mismatches=[], violations=[], unexercised=[],
                late_cancels=1, cancels_landed_on={0: 1, 1: 1, 2: 1})
    return SessionSummary(**(base | fields))


def test_operations_verdict_warns_for_what_timing_left_out_and_fails_only_for_wrong_answers():
    options = StressOptions()
    verdict, warnings = operations_verdict(options, [_summary("a")], 3)
    assert verdict.passed and warnings == []
    # a cancel that never landed on daemon 2 and no late cancel: warnings, the verdict still passes
    verdict, warnings = operations_verdict(options, [_summary("a", cancels_landed_on={0: 2, 1: 1}, late_cancels=0, cancel_attempts_missed=3)], 3)
    assert verdict.passed and any("daemon 2" in w for w in warnings) and any("after completion" in w for w in warnings)
    # an operation that ran and got a wrong answer fails it
    verdict, _ = operations_verdict(options, [_summary("a", failed_op="late cancel (after completion, every daemon)", violations=["x"])], 3)
    assert not verdict.passed and "late cancel" in verdict.detail


def test_plans_aim_a_cancel_at_every_daemon_and_after_completion_and_place_each_fault_once():
    for sessions in (1, 2, 4, 7):
        options = StressOptions(sessions=sessions, seed=sessions)
        targets = cancel_targets(options, 3)
        assert {t for per_session in targets for t in per_session} == {LATE_CANCEL, 0, 1, 2}
        plans = build_plans(options, 3)
        for plan in plans:  # one forced cancel per target
            assert sum(kind is OpKind.CANCEL for _at, kind in plan.forced) == len(plan.cancel_targets) >= 1
    options = StressOptions(kill_worker=True, kill_supervisor=True, stall_worker=True, seed=3)
    faults = [fault for plan in build_plans(options, 3) for fault in plan.faults]
    assert sorted(fault.kind for fault in faults) == sorted(FaultKind)
    assert all(0 <= fault.stage < 3 and fault.from_op < options.ops for fault in faults)
    assert build_plans(StressOptions(), 3) == build_plans(StressOptions(), 3)  # seeded


# ---- the checks themselves can fail ---------------------------------------------------------------------


def test_replay_alone_catches_other_logits_a_different_partition_and_a_wrong_greedy_token(shard_sets, prompt_ids):
    """The comparison is sensitive: other logits, the same rows appended one at a time, a wrong token."""
    prompt, other = prompt_ids[0], prompt_ids[1]
    local = LocalReference([shard.path for shard in shard_sets[EVEN_SPLIT]], n_ctx=256)
    try:
        local.begin()
        whole = np.array(local.append(0, prompt), copy=True)
        local.end()
        token = int(np.argmax(whole))
        honest = [LoggedAppend(0, tuple(prompt), row_digest(whole), False)]
        assert replay_alone(honest, local, "honest").mismatches == []
        # cross-talk: the logits another session's rows would give
        crossed = [LoggedAppend(0, tuple(other), row_digest(whole), False)]
        assert len(replay_alone(crossed, local, "crossed").mismatches) == 1
        # every row its own append: the single-row kernels give other bits than one prefill (measured)
        one_by_one = [LoggedAppend(i, (t,), row_digest(whole) if i == len(prompt) - 1 else "-", False) for i, t in enumerate(prompt)]
        outcome = replay_alone(one_by_one, local, "one-by-one")
        assert any(m.startswith(f"one-by-one op {len(prompt) - 1}:") for m in outcome.mismatches)
        wrong_token = honest + [LoggedAppend(len(prompt), ((token + 1) % 49152,), "-", True)]
        assert any("greedy token" in m for m in replay_alone(wrong_token, local, "greedy").mismatches)
        # truncate and reset entries replay too
        again = honest + [LoggedTruncate(3), LoggedReset()] + honest
        outcome = replay_alone(again, local, "again")
        assert outcome.mismatches == [] and outcome.checked_rows == 2
        assert np.array_equal(outcome.final_row, whole)
    finally:
        local.close()


def _daemon() -> DaemonSummary:
    return DaemonSummary(socket="d.sock", layers="[0, 10)", limit_bytes=1, session_charge_bytes=0, peak_reserved_bytes=0, reserved_before=0, reserved_after=0,
                         our_sessions_after=0, integrity_after="ok", counters={}, workers=[], replaced_pids=[])


def test_restart_verdict_fails_on_a_full_replay_a_missing_drain_or_no_restore():
    restarts = [RestartRecord(daemon=i, pid=10 + i, at_ops=4 * i, exit_code=0, new_pid=20 + i) for i in range(3)]
    good = [_summary("a", restores=2), _summary("b", restores=1, tail_replays=1, tail_replayed_tokens=3)]
    assert restart_verdict(restarts, "", good, 3, True).passed
    assert not restart_verdict(restarts, "", [_summary("a", restores=2, full_replays=1)], 3, True).passed
    assert not restart_verdict(restarts[:2], "", good, 3, True).passed  # daemon 2 never drained
    assert not restart_verdict([msgspec.structs.replace(restarts[0], exit_code=1), *restarts[1:]], "", good, 3, True).passed
    assert not restart_verdict(restarts, "", [_summary("a")], 3, True).passed  # nothing restored
    assert not restart_verdict(restarts, "", good, 3, False).passed  # not exact


def test_kill_supervisor_verdict_with_persist_after_fails_when_an_adopted_session_replays_from_zero():
    def kill(adopted):
        return SupervisorKillRecord(daemon=1, pid=5, session_id="a", op_index=3, descendants=[6], segments=[], all_gone_s=0.1, new_pid=7,
                                    victim_copy=SavedState("a", 1, 40), adopted=[SavedState(s, 1, 40) for s in adopted])
    daemons = [_daemon() for _ in range(3)]
    tail = _summary("a", tail_replays=1, tail_replayed_tokens=2)
    assert kill_supervisor_verdict([kill(["a"])], [tail, _summary("b", full_replays=1)], daemons, [], True, 1.0).passed  # b had no copy
    assert not kill_supervisor_verdict([kill(["a", "b"])], [tail, _summary("b", full_replays=1)], daemons, [], True, 1.0).passed
    assert not kill_supervisor_verdict([kill(["b"])], [tail, _summary("b")], daemons, [], True, 1.0).passed  # the victim's copy not adopted


class _Route:
    """A route of two fake daemons, each holding a length of one session: what RoutedSession relies on."""

    clients = [None, None]

    def __init__(self) -> None:
        self.held = [0, 0]
        self.calls: list[tuple] = []
        self.restart_with: int | None = None  # the next truncate loses daemon 1, which comes back holding this

    def __len__(self) -> int:
        return 2

    def _mismatch(self, stage: int) -> StageFailed:
        return StageFailed(stage, KvpoolError(ErrorReply(code=ErrorCode.POSITION_MISMATCH, message="", length=self.held[stage])))

    def append_at(self, stage, session_id, epoch, start, rows, **options) -> AppendResult:
        if self.held[stage] != start:
            raise self._mismatch(stage)
        self.held[stage] = start + len(rows)
        self.calls.append(("append", stage, start, len(rows)))
        return AppendResult(length=self.held[stage], rows=np.zeros((len(rows), 4), np.float32), admitted=start == 0)

    def truncate(self, session_id, epoch, length, *, stages=None) -> None:
        for stage in range(2) if stages is None else stages:
            if stage == 1 and self.restart_with is not None:
                self.held[1], self.restart_with = self.restart_with, None
                raise ConnectionLost("daemon 1 restarted")
            if self.held[stage] < length:
                raise self._mismatch(stage)
            self.held[stage] = length
            self.calls.append(("truncate", stage, length))

    def release(self, session_id, epoch) -> None:
        self.held = [0, 0]
        self.calls.append(("release",))


def test_a_connection_lost_in_a_truncate_costs_only_the_tail_from_what_the_restarted_daemon_holds():
    """The router's rule the drills rely on: a truncate whose connection to a daemon was lost (a daemon
    restarted with a copy written behind at length 4) is followed by a tail replay from 4, not from 0."""
    route = _Route()
    session = RoutedSession(route, RecoveryPolicy(), "s", epoch=1, n_ctx=64, admit_timeout_s=0.0, rng=random.Random(0), count=lambda field, amount: None)
    for chunk in ([1, 2, 3, 4], [5, 6, 7], [8, 9]):
        session.append(chunk)
    route.restart_with = 4
    session.truncate(7)
    route.calls.clear()
    session.append([10])
    assert ("release",) not in route.calls and session.epoch == 1
    assert route.calls == [("truncate", 0, 7), ("truncate", 0, 4), ("truncate", 1, 4), ("append", 0, 4, 3), ("append", 1, 4, 3), ("append", 0, 7, 1), ("append", 1, 7, 1)]
    counts = session.counts
    assert (counts.replays, counts.tail_replays, counts.tail_replayed_tokens, counts.connections_lost) == (0, 1, 3, 1)
    assert route.held == [8, 8] and session.length == 8


def test_options_are_validated():
    for bad in (dict(sessions=0), dict(ops=-1), dict(budget_for=0), dict(ttl_s=0), dict(parts=1), dict(n_ctx=64),
                dict(reference="nope"), dict(sockets=(pathlib.Path("/tmp/x.sock"),), budget_for=2)):
        with pytest.raises(ValueError):
            StressOptions(**bad)
    for bad in (dict(stall_timeout_s=0), dict(sockets=(pathlib.Path("/tmp/x.sock"),), kill_supervisor=True),
                dict(sockets=(pathlib.Path("/tmp/x.sock"),), stall_worker=True), dict(persist_after_s=-0.1, kill_supervisor=True),
                dict(sockets=(pathlib.Path("/tmp/x.sock"),), restart=True), dict(restart=True, budget_for=2), dict(restart=True, kill_supervisor=True)):
        with pytest.raises(ValueError):
            StressOptions(**bad)
    assert StressOptions(budget_for=2, ttl_s=1.0, kill_worker=True).scenario == "budget-for-2+ttl-1+kill-worker"
    assert StressOptions(kill_supervisor=True, stall_worker=True, slow_reader=True).scenario == "kill-supervisor+stall-worker+slow-reader"
    edge = StressOptions(kill_supervisor=True, persist_after_s=0)  # 0: a copy as soon as a session is idle
    assert edge.durable and edge.scenario == "kill-supervisor+persist-after-0"
    assert StressOptions(restart=True).durable and not StressOptions(restart=True).may_lose_state  # a drain loses nothing
    for bad in (dict(shared_prefix=True, spill=True), dict(shared_prefix=True, budget_for=2), dict(shared_prefix=True, kill_worker=True),
                dict(shared_prefix=True, sockets=(pathlib.Path("/tmp/x.sock"),)), dict(shared_prefix=True, prefix_block=0),
                dict(shared_prefix=True, prefix_block=200), dict(shared_prefix=True, prefix_cache_bytes=0)):
        with pytest.raises(ValueError):
            StressOptions(**bad)
    assert StressOptions(shared_prefix=True, mode="batched").scenario == "batched+shared-prefix"
    assert StressOptions(shared_prefix=True).warm_tier and not StressOptions().warm_tier


def test_script_and_subcommand_help_and_bad_options():
    root = pathlib.Path(__file__).resolve().parents[2]
    script = subprocess.run([sys.executable, str(root / "scripts" / "stress_four_sessions.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "--budget-for" in script.stdout and "--kill-worker" in script.stdout
    assert all(flag in script.stdout for flag in ("--kill-supervisor", "--stall-worker", "--stall-timeout", "--slow-reader", "--restart", "--persist-after"))
    command = subprocess.run([sys.executable, "-m", "kvpool", "stress", "--help"], capture_output=True, text=True, timeout=60)
    assert command.returncode == 0 and "--sockets" in command.stdout
    assert all(flag in command.stdout for flag in ("--shared-prefix", "--prefix-block", "--prefix-cache-budget"))
    bad = subprocess.run([sys.executable, "-m", "kvpool", "stress", "--sessions", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--sessions must be at least 1" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "kvpool", "stress", "--persist-after", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--persist-after must be >= 0" in bad.stderr


@pytest.mark.timeout(HANG_GUARD_S)
def test_batched_mode_every_session_exact_and_a_killed_worker_loses_only_its_own_sessions(tmp_path):
    """Issue 12: the daemons in --mode batched (one worker process per daemon holds the four sessions as
    sequences of one context). A SIGKILLed worker process is worker_lost for its sessions, which replay;
    every session ends exact, isolation included (the reference replays each session alone)."""
    report = _run(tmp_path, mode="batched", kill_worker=True, seed=5)
    _assert_common(report)
    assert report.options["mode"] == "batched"
    assert _verdict(report, "kill_worker").passed
    assert report.errors_by_code.get("worker_lost", 0) >= 1


@pytest.mark.timeout(HANG_GUARD_S)
def test_replan_moves_every_session_onto_another_split_and_back_exactly(tmp_path):
    """--replan: three sessions re-planned from 3 shards onto 4 cut elsewhere and back, mid-run, while the
    others keep appending: every re-plan moved its session (no replay), all exact, the second chain empty."""
    report = _run(tmp_path, replan=True, sessions=3, ops=DRILL_OPS, seed=5)
    _assert_common(report)
    assert report.scenario == "replan-3-4" and _verdict(report, "replan").passed
    assert len(report.replans) == 2 * 3 and [r.onto.split()[0] for r in report.replans if r.session_id.endswith("-0")] == ["second", "first"]
    moved = [r for r in report.replans if r.outcome == "moved"]
    assert moved and all(r.moved_bytes > 0 and r.length > 0 for r in moved)
    assert not [r for r in report.replans if r.outcome == "failed"]
    with pytest.raises(ValueError):
        StressOptions(replan=True, kill_worker=True)
    with pytest.raises(ValueError):
        StressOptions(replan=True, replan_parts=3)


# ---- --shared-prefix ----------------------------------------------------------------------------------------


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.parametrize("mode", ["process", "batched"])
def test_shared_prefix_sessions_start_from_stored_prefixes_and_each_is_exact(tmp_path, mode):
    """Issue 28 item 8: prompts sharing system prompts (whole, cut inside a block, none) through daemons with a
    prefix store of 16-token blocks that evicts, on two places each, under cancels, truncates, releases and epoch
    bumps: fresh sessions start from stored prefixes (the router and every daemon count the hits), and every
    session equals its appends alone, each prompt computed there in one chunk."""
    report = _run(tmp_path, shared_prefix=True, mode=mode, ops=DRILL_OPS, seed=2)
    _assert_common(report)
    assert report.scenario == ("shared-prefix" if mode == "process" else "batched+shared-prefix")
    assert _verdict(report, "shared_prefix").passed and _verdict(report, "progress").passed
    hits, tokens = sum(s.prefix_hits for s in report.sessions), sum(s.prefix_hit_tokens for s in report.sessions)
    assert hits > 0 and tokens > 0 and sum(s.recoveries for s in report.sessions) == 0  # no replay: every hit a fresh start
    block = report.options["prefix_block"]
    for session in report.sessions:
        assert sum(session.prefix_starts) == session.prefix_hit_tokens and len(session.prefix_starts) >= 3  # the first, a release, an epoch bump
        assert all(reused % block == 0 and reused <= session.prompt_tokens - 2 for reused in session.prefix_starts)
    for daemon in report.daemons:
        assert daemon.counters["prefix_hits"] >= hits and daemon.counters["prefix_hit_tokens"] >= tokens
        assert daemon.counters["prefix_stored"] > 0 and daemon.prefix_store is not None and daemon.prefix_store.bytes <= daemon.prefix_store.limit_bytes
    assert {code for code in report.errors_by_code if code.startswith("cache_miss/")} <= {"cache_miss/new_epoch", "cache_miss/prefix_evicted"}  # nothing lost


def test_shared_prefix_prompts_share_system_prompts_and_prefill_chunks_keep_reuse_checkable(tokenizer):
    for sessions, seed in ((4, 0), (6, 1), (8, 2)):
        prompts = shared_prompts(tokenizer, sessions, seed, 16)
        kinds = [prompt.kind for prompt in prompts]
        assert "none" in kinds and any("cut at" in kind for kind in kinds)
        for kind in {kind.split(" cut")[0] for kind in kinds if kind != "none"}:  # every system prompt given to two sessions or more
            assert sum(k.split(" cut")[0] == kind for k in kinds) >= 2
        for prompt in prompts:
            if "cut at" in prompt.kind:
                assert int(prompt.kind.rsplit(" ", 1)[1]) % 16  # diverges inside a block
            assert prompt.follows is None or prompt.shared_tokens >= 16
        for a in prompts:
            for b in prompts:
                assert a is b or a.tokens[: len(b.tokens)] != b.tokens  # no prompt is a prefix of another
    rng = random.Random(0)
    assert prefill_rows(0, 90, 40, rng) == 40  # a fresh session's first append: its whole prompt
    for pending in range(1, 60):
        rows = prefill_rows(7, pending, 40, rng)
        assert 1 <= rows <= pending and pending - rows != 1 and (rows > 1 or pending == 1)


def test_shared_prefix_verdict_fails_without_a_hit_or_when_a_daemon_admitted_less():
    daemons = [msgspec.structs.replace(_daemon(), counters={"prefix_hits": 2, "prefix_hit_tokens": 48, "prefix_stored": 3, "prefix_evictions": 1, "spills": 2}) for _ in range(3)]
    hit = _summary("a", prefix_hits=2, prefix_hit_tokens=48, prefix_starts=[16, 32])
    verdict, warnings = shared_prefix_verdict([hit], daemons, True)
    assert verdict.passed and warnings == []
    verdict, _ = shared_prefix_verdict([_summary("a", prefix_starts=[0, 0])], daemons, True)
    assert not verdict.passed and "no session started from a stored prefix" in verdict.detail
    short = [*daemons[:2], msgspec.structs.replace(_daemon(), counters={"prefix_hits": 1, "prefix_hit_tokens": 16})]
    verdict, _ = shared_prefix_verdict([hit], short, True)
    assert not verdict.passed and "a daemon admitted fewer" in verdict.detail
    verdict, warnings = shared_prefix_verdict([_summary("a", prefix_hits=1, prefix_hit_tokens=16, prefix_starts=[0, 16])], [_daemon()] * 3, True)
    assert not verdict.passed  # the daemons count no admission
    assert any("evicted" in w for w in warnings) and any("first start" in w for w in warnings) and any("parked" in w for w in warnings)
    assert not shared_prefix_verdict([hit], daemons, False)[0].passed  # not exact

"""The four-session stress run and its fault drills, bounded for CI: a regression in isolation fails here.

Each test is one `kvpool stress` run in process (kvpool.stress.run_stress): a chain of three daemons on
the bundled model, four sessions x 40 operations (16 for the newer drills), then every session replayed
alone on a fresh chain. Every run is bounded by operations; the timeouts are hang guards only, far above
what the slowest, busiest machine needs. No assertion depends on speed: what timing decides (whether a
cancel lands mid-prefill) is at most a warning in the report.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest

from kvpool.client.client import Client, ConnectionLost
from kvpool.shard.cache import shards_in_parts
from kvpool.stress import (
    LATE_CANCEL,
    FaultKind,
    LocalReference,
    LoggedAppend,
    LoggedReset,
    LoggedTruncate,
    OpKind,
    SessionSummary,
    StressOptions,
    StressReport,
    build_plans,
    cancel_targets,
    operations_verdict,
    replay_alone,
    row_digest,
    run_stress,
)
from tests.conftest import EVEN_SPLIT

SESSIONS = 4
OPS = 40
DRILL_OPS = 16
OVERLOAD_SESSIONS = 8
OVERLOAD_OPS = 12
HANG_GUARD_S = 1200
COMMON_VERDICTS = {"contract", "exact", "operations", "books_at_every_sample", "released", "worker_memory"}


def _run(tmp_path: pathlib.Path, **overrides) -> StressReport:
    json_path = tmp_path / "stress.json"
    report = run_stress(StressOptions(**{"sessions": SESSIONS, "ops": OPS, "json_path": json_path} | overrides))
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
    report = _run(tmp_path)
    _assert_common(report)
    assert report.scenario == "default"
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
    report = _run(tmp_path, budget_for=2, seed=1, min_residency_s=0)  # plain LRU: no residency spares anyone
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
    report = _run(tmp_path, spill=True, ops=DRILL_OPS, seed=3)
    _assert_common(report)
    assert report.scenario == "spill" and _verdict(report, "warm_tier").passed
    assert sum(sum(session.misses.values()) for session in report.sessions) == 0
    assert sum(session.recoveries for session in report.sessions) == 0
    assert all(daemon.counters["restores"] > 0 and daemon.counters["spills"] >= daemon.counters["restores"] for daemon in report.daemons)
    assert not {code for code in report.errors_by_code if code.startswith("cache_miss/")} - {"cache_miss/new_epoch"}


@pytest.mark.timeout(HANG_GUARD_S)
def test_ttl_one_second_expires_idle_sessions(tmp_path):
    report = _run(tmp_path, ttl_s=1.0, seed=2)
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
    assert kill.descendants and not kill.orphans_at_deadline and kill.all_gone_s is not None  # gone within 5 s
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
def test_stalled_worker_answers_worker_lost_after_the_request_timeout_and_is_replaced(tmp_path):
    report = _run(tmp_path, stall_worker=True, seed=5, ops=DRILL_OPS)
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


def test_options_are_validated():
    for bad in (dict(sessions=0), dict(ops=-1), dict(budget_for=0), dict(ttl_s=0), dict(parts=1), dict(n_ctx=64),
                dict(reference="nope"), dict(sockets=(pathlib.Path("/tmp/x.sock"),), budget_for=2)):
        with pytest.raises(ValueError):
            StressOptions(**bad)
    for bad in (dict(stall_timeout_s=0), dict(sockets=(pathlib.Path("/tmp/x.sock"),), kill_supervisor=True),
                dict(sockets=(pathlib.Path("/tmp/x.sock"),), stall_worker=True)):
        with pytest.raises(ValueError):
            StressOptions(**bad)
    assert StressOptions(budget_for=2, ttl_s=1.0, kill_worker=True).scenario == "budget-for-2+ttl-1+kill-worker"
    assert StressOptions(kill_supervisor=True, stall_worker=True, slow_reader=True).scenario == "kill-supervisor+stall-worker+slow-reader"


def test_script_and_subcommand_help_and_bad_options():
    root = pathlib.Path(__file__).resolve().parent.parent
    script = subprocess.run([sys.executable, str(root / "scripts" / "stress_four_sessions.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "--budget-for" in script.stdout and "--kill-worker" in script.stdout
    assert all(flag in script.stdout for flag in ("--kill-supervisor", "--stall-worker", "--stall-timeout", "--slow-reader"))
    command = subprocess.run([sys.executable, "-m", "kvpool", "stress", "--help"], capture_output=True, text=True, timeout=60)
    assert command.returncode == 0 and "--sockets" in command.stdout
    bad = subprocess.run([sys.executable, "-m", "kvpool", "stress", "--sessions", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--sessions must be at least 1" in bad.stderr


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

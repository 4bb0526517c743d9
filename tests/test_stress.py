"""The four-session stress run and its fault drills, bounded for CI: a regression in isolation fails here.

Each test is one `kvpool stress` run in process (kvpool.stress.run_stress): a chain of three daemons on
the bundled model, four sessions x 40 operations, then every session replayed alone on a fresh chain.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from kvpool.stress import (
    LocalReference,
    LoggedAppend,
    LoggedReset,
    LoggedTruncate,
    StressOptions,
    StressReport,
    replay_alone,
    row_digest,
    run_stress,
)
from tests.conftest import EVEN_SPLIT

SESSIONS = 4
OPS = 40
COMMON_VERDICTS = {"contract", "exact", "operations", "books_at_every_sample", "released", "worker_memory"}


def _run(tmp_path: pathlib.Path, **overrides) -> StressReport:
    json_path = tmp_path / "stress.json"
    report = run_stress(StressOptions(sessions=SESSIONS, ops=OPS, json_path=json_path, **overrides))
    failed = [f"{v.name}: {v.detail}" for v in report.verdicts if not v.passed]
    assert report.passed and not failed, failed
    # the --json document is the same report
    assert msgspec.json.decode(json_path.read_bytes(), type=StressReport).verdicts == report.verdicts
    return report


def _verdict(report: StressReport, name: str):
    return next(verdict for verdict in report.verdicts if verdict.name == name)


def _assert_common(report: StressReport) -> None:
    assert COMMON_VERDICTS <= {verdict.name for verdict in report.verdicts}
    assert len(report.sessions) == SESSIONS
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


@pytest.mark.timeout(240)
def test_default_four_sessions_equal_each_alone(tmp_path):
    report = _run(tmp_path)
    _assert_common(report)
    assert report.scenario == "default"
    for kind in ("prefill", "decode", "truncate", "cancel", "release_reopen", "epoch_bump", "stale_epoch"):
        assert report.ops_by_kind[kind] > 0 and report.latency_ms[kind].count > 0
    # nothing but the drills' own expected replies: no eviction, expiry or lost worker without a fault
    assert set(report.errors_by_code) == {"stale_epoch", "cache_miss/new_epoch", "cancelled"}
    assert sum(session.recoveries for session in report.sessions) == 0


@pytest.mark.timeout(240)
def test_budget_for_two_of_four_evicts_lru_and_evicted_sessions_replay_exactly(tmp_path):
    report = _run(tmp_path, budget_for=2, seed=1)
    _assert_common(report)
    assert _verdict(report, "lru_eviction").passed
    assert report.errors_by_code.get("cache_miss/evicted", 0) > 0
    assert sum(session.misses.get("evicted", 0) for session in report.sessions) > 0
    for daemon in report.daemons:
        assert 2 * daemon.session_charge_bytes <= daemon.limit_bytes < 3 * daemon.session_charge_bytes
        assert daemon.peak_reserved_bytes <= daemon.limit_bytes
    assert sum(daemon.counters["evictions"] for daemon in report.daemons) > 0


@pytest.mark.timeout(240)
def test_ttl_one_second_expires_idle_sessions(tmp_path):
    report = _run(tmp_path, ttl_s=1.0, seed=2)
    _assert_common(report)
    assert _verdict(report, "ttl_expiry").passed
    assert report.errors_by_code["cache_miss/expired"] >= SESSIONS  # every session idled once
    assert report.ops_by_kind["idle_expire"] == SESSIONS


@pytest.mark.timeout(240)
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
    assert StressOptions(budget_for=2, ttl_s=1.0, kill_worker=True).scenario == "budget-for-2+ttl-1+kill-worker"


def test_script_and_subcommand_help_and_bad_options():
    root = pathlib.Path(__file__).resolve().parent.parent
    script = subprocess.run([sys.executable, str(root / "scripts" / "stress_four_sessions.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "--budget-for" in script.stdout and "--kill-worker" in script.stdout
    command = subprocess.run([sys.executable, "-m", "kvpool", "stress", "--help"], capture_output=True, text=True, timeout=60)
    assert command.returncode == 0 and "--sockets" in command.stdout
    bad = subprocess.run([sys.executable, "-m", "kvpool", "stress", "--sessions", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--sessions must be at least 1" in bad.stderr

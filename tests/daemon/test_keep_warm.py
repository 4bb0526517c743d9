"""--keep-warm on a real daemon of the bundled model: an append on a worker's direct channel, which the supervisor
never sees, touches the daemon's stamp as the supervisor's own requests do (kvpool status says how long ago the
last request ended); the spinners, one a CPU, go with the daemon."""

from __future__ import annotations

import os
import re

import psutil

from tests.support.daemons import DaemonProcess, exited_all, wait_until

OPTIONS = ("--n-ctx", "64", "--max-sessions", "1", "--calibration-cache", "off")
TOKENS = [1, 50, 60, 70, 80, 90, 100, 110, 120]
QUIET_S = 2.0  # between the two appends: the second's touch is told apart from the first's by the age it resets


def _since(keep_warm: str) -> float:
    return float(re.search(r"the last session request ended ([0-9.]+) s ago", keep_warm).group(1))


def test_a_direct_append_touches_the_stamp_and_the_spinners_go_with_the_daemon(model_path, socket_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the spinners' CPU locks: this test's own
    daemon = DaemonProcess(model_path, socket_dir / "warm.sock", "--keep-warm", "600", *OPTIONS)
    try:
        spinners = wait_until(
            lambda: [child for child in psutil.Process(daemon.process.pid).children() if "kvpool.daemon.keep_warm" in " ".join(child.cmdline())],
            "the daemon's spinners",
        )
        assert sorted(int(child.cmdline()[child.cmdline().index("--cpu") + 1]) for child in spinners) == sorted(os.sched_getaffinity(daemon.process.pid))
        with daemon.client() as client:
            assert "no session request yet" in client.stats().keep_warm
            client.append("s", 1, 0, tokens=TOKENS[:8])  # admitted through the supervisor (Gate.leave touches)
            stats = client.stats()
            direct_before = stats.counters.get("direct_appends", 0)
            wait_until(lambda: _since(client.stats().keep_warm) >= QUIET_S, f"{QUIET_S:g} s since the first append")
            client.append("s", 1, 8, tokens=TOKENS[8:])  # on the worker's direct channel: only the worker touches
            stats = client.stats()
        assert stats.counters["direct_appends"] == direct_before + 1  # it did go direct
        assert _since(stats.keep_warm) < QUIET_S, stats.keep_warm
        wait_until(lambda: all(os.sched_getscheduler(child.pid) == os.SCHED_IDLE for child in spinners), "the spinners at idle priority")
    finally:
        assert daemon.stop() == 0
    assert exited_all(spinners, "the spinners after the daemon stopped") == []

"""kvpool.launcher: a daemon's start is waited for with a hang guard that says where the start-up stands."""

from __future__ import annotations

import os
import signal

import pytest

from kvpool import launcher
from kvpool.launcher import Daemon, DaemonStartFailed
from tests.support.daemons import HANG_GUARD_S, in_thread, result, wait_until

PROGRESS_LINES = 3
ONE_PLACE = ("--threads", "1", "--n-ctx", "64", "--max-sessions", "1")


def test_waiting_for_a_start_says_where_it_stands_and_only_a_hang_fails(shards, socket_dir, monkeypatch):
    monkeypatch.setattr(launcher, "PROGRESS_EVERY_S", 0.2)
    # A start that makes no progress (the daemon stopped, on any machine) is waited for, and said so, for as
    # long as it takes: once PROGRESS_LINES lines were said, the daemon goes on, and the wait ends in its start.
    slow = Daemon(shards[1].path, socket_dir / "slow-start.sock", ONE_PLACE)
    said: list[str] = []
    try:
        os.kill(slow.process.pid, signal.SIGSTOP)
        waiting, outcome = in_thread(lambda: slow.wait_ready(timeout_s=HANG_GUARD_S, say=said.append))
        try:
            wait_until(lambda: len(said) >= PROGRESS_LINES, f"{PROGRESS_LINES} progress lines while the start is stopped")
        finally:
            os.kill(slow.process.pid, signal.SIGCONT)
        result(waiting, outcome)  # started: not failed, however long it was stopped
        assert all("waiting for the daemon of" in line for line in said), said
        with slow.client() as client:
            assert client.stats().integrity == "ok"
    finally:
        assert slow.stop() == 0
    # Only a hang fails: a start that never progresses ends at the guard, whose limit the error names.
    hung = Daemon(shards[1].path, socket_dir / "hung-start.sock", ONE_PLACE)
    try:
        os.kill(hung.process.pid, signal.SIGSTOP)
        with pytest.raises(DaemonStartFailed, match="hang guard of 2 s"):
            hung.wait_ready(timeout_s=2.0, say=said.append)
    finally:
        hung.stop(sig=signal.SIGKILL)

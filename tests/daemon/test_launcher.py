"""kvpool.launcher: a daemon's start is waited for with a hang guard that says where the start-up stands."""

from __future__ import annotations

import os
import signal

import pytest

from kvpool import launcher
from kvpool.launcher import Daemon, DaemonStartFailed


def test_waiting_for_a_start_says_where_it_stands_and_only_a_hang_fails(shards, socket_dir, monkeypatch):
    monkeypatch.setattr(launcher, "PROGRESS_EVERY_S", 0.2)
    daemon = Daemon(shards[1].path, socket_dir / "slow-start.sock", ("--threads", "1", "--n-ctx", "64", "--max-sessions", "1"))
    said: list[str] = []
    try:
        os.kill(daemon.process.pid, signal.SIGSTOP)  # a start that makes no progress, on any machine
        with pytest.raises(DaemonStartFailed, match="hang guard of 2 s"):
            daemon.wait_ready(timeout_s=2.0, say=said.append)
        assert len(said) >= 3 and all("waiting for the daemon of" in line for line in said), said
    finally:
        daemon.stop(sig=signal.SIGKILL)
    started = Daemon(shards[1].path, socket_dir / "start.sock", ("--threads", "1", "--n-ctx", "64", "--max-sessions", "1"))
    try:
        started.wait_ready(say=said.append)  # the default guard: a normal start is waited for, however slow
        with started.client() as client:
            assert client.stats().integrity == "ok"
    finally:
        assert started.stop() == 0

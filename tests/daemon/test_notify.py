"""Readiness and service managers (issue 20, item 5) in real `kvpool serve` processes: sd_notify datagrams to
the NOTIFY_SOCKET of its environment (READY=1 only once its socket answers, STATUS= milestones, STOPPING=1 on
SIGTERM), a NOTIFY_SOCKET that leads nowhere, `kvpool status --wait-ready` on a starting daemon, `kvpool
serve --config FILE.toml` and `--log-format json` in a running daemon's log. The notifier alone, the
supervisor's notifications on fake workers, --wait-ready where nothing answers, config file refusals and
values and the log formats: tests/unit/test_notify.py.

Waits are hang guards only.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from kvpool.launcher import Daemon
from tests.support.daemons import HANG_GUARD_S, START_HANG_GUARD_S, DaemonProcess, wait_until
from tests.support.notify import NotifyListener

SMALL = ("--threads", "1", "--n-ctx", "64", "--max-sessions", "2")
KVPOOL = [sys.executable, "-m", "kvpool"]


# ---- a service manager's end of NOTIFY_SOCKET -----------------------------------------------------




@pytest.fixture
def listener(socket_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    path = socket_dir / "manager.notify"
    path.unlink(missing_ok=True)
    manager = NotifyListener(str(path), socket_dir / "notified.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", manager.address)  # the daemons started here inherit it
    yield manager
    manager.close()


# ---- the daemon and its service manager -----------------------------------------------------------


def test_ready_only_once_the_socket_answers_then_status_lines_and_stopping_on_sigterm(shards, listener):
    daemon = Daemon(shards[0].path, listener.daemon_socket, SMALL)
    try:
        ready = wait_until(lambda: [d for d in listener.datagrams if "READY=1" in d[0].splitlines()], "READY=1", START_HANG_GUARD_S)
        daemon.wait_ready()
        assert ready[0][1], "READY=1 arrived while the daemon's socket did not answer yet"
        lines = listener.lines()
        statuses = [line for line in lines if line.startswith("STATUS=")]
        assert statuses[0] == "STATUS=2 workers started; probing charges", lines
        assert statuses[1].startswith("STATUS=charges probed ("), lines
        assert statuses[2] == f"STATUS=ready on {listener.daemon_socket}: 2 sessions (process mode)", lines
        assert lines.index("READY=1") > lines.index(statuses[1])
        assert "STOPPING=1" not in lines
        with daemon.client() as client:
            assert client.append("s", 1, 0, tokens=[1, 2, 3]).length == 3
    finally:
        code = daemon.stop()  # SIGTERM
    assert code == 0, daemon.log()
    lines = listener.lines()
    assert lines.count("STOPPING=1") == 1 and lines.count("READY=1") == 1, lines
    assert lines.index("STOPPING=1") > lines.index("READY=1")
    assert "cannot notify" not in daemon.log()


def test_a_notify_socket_leading_nowhere_costs_one_log_line(shards, socket_dir, monkeypatch):
    nowhere = socket_dir / "nobody.notify"
    nowhere.unlink(missing_ok=True)
    monkeypatch.setenv("NOTIFY_SOCKET", str(nowhere))
    daemon = DaemonProcess(shards[0].path, socket_dir / "nowhere.sock", *SMALL)
    try:
        with daemon.client() as client:
            assert client.append("s", 1, 0, tokens=[1, 2]).length == 2
    finally:
        code = daemon.stop()
    log = daemon.log()
    assert code == 0, log
    failures = [line for line in log.splitlines() if "cannot notify the service manager" in line]
    # four sends failed (two STATUS, READY, STOPPING): one line, which names the address and the cause
    assert len(failures) == 1, log
    assert failures[0] == f"kvpool serve: cannot notify the service manager on NOTIFY_SOCKET={nowhere}: No such file or directory (later failures are not logged)"
    assert "Traceback" not in log


# ---- kvpool status --wait-ready -------------------------------------------------------------------


def test_wait_ready_waits_for_a_starting_daemon_and_prints_its_status(shards, socket_dir, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    path = socket_dir / "waited.sock"
    daemon = Daemon(shards[0].path, path, SMALL)  # not waited for here: --wait-ready does the waiting
    try:
        waited = subprocess.run(
            [*KVPOOL, "status", "--socket", str(path), "--wait-ready", str(START_HANG_GUARD_S), "--json"],
            capture_output=True, text=True, timeout=START_HANG_GUARD_S + 60,
        )
        assert waited.returncode == 0, waited.stderr + daemon.log()
        stats = json.loads(waited.stdout)
        assert len(stats["workers"]) == 2 and stats["sessions"] == []
        assert all(line.startswith("kvpool status: waiting for ") for line in waited.stderr.splitlines()), waited.stderr
    finally:
        assert daemon.stop() == 0, daemon.log()


# ---- kvpool serve --config FILE.toml, --log-format json -------------------------------------------


def test_config_file_sets_flags_a_flag_overrides_and_json_log_lines_without_notify_socket(shards, socket_dir, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    config = socket_dir / "serve.toml"
    config.write_text('# kvpool serve flags\nn-ctx = 128\nmax-sessions = 3\nthreads = 1\nttl = 60\n')
    daemon = DaemonProcess(shards[0].path, socket_dir / "configured.sock", "--config", str(config), "--max-sessions", "2", "--log-format", "json")
    try:
        with daemon.client() as client:
            assert client.hello.max_n_ctx == 128  # from the file
            assert client.append("s", 1, 0, tokens=[1, 2, 3]).length == 3
        status = subprocess.run([*KVPOOL, "status", "--socket", str(daemon.socket), "--json"], capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert status.returncode == 0, status.stderr
        assert len(json.loads(status.stdout)["workers"]) == 2  # the command line's --max-sessions, not the file's 3
    finally:
        code = daemon.stop()
    log = daemon.log()
    assert code == 0, log
    lines = [json.loads(line) for line in log.splitlines()]  # every line is one JSON object
    assert all({"time", "level", "message", "logger", "pid"} <= set(line) for line in lines), lines
    messages = [line["message"] for line in lines]
    assert any(message.startswith(f"ready on {daemon.socket}: ") and "for 2 sessions" in message for message in messages), messages
    assert messages[-1] == "stopped" and {line["level"] for line in lines} == {"info"}

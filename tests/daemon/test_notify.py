"""Readiness and service managers (issue 20, item 5): sd_notify datagrams from a real daemon (READY=1 only once
its socket answers, STATUS= milestones, STOPPING=1 on SIGTERM), a NOTIFY_SOCKET that is absent or leads
nowhere, `kvpool status --wait-ready`, `kvpool serve --config FILE.toml` and `--log-format json`.

Waits are hang guards only; the one short TIMEOUT (2 s) is a test of the timeout path, not of speed.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvpool.cli import serve
from kvpool.cli.config_file import ConfigFileError, file_keys, with_file
from kvpool.client.client import Client, ConnectionLost
from kvpool.daemon import logs
from kvpool.daemon.notify import Notifier, socket_address
from kvpool.launcher import Daemon, wait_answering
from tests.support.daemons import HANG_GUARD_S, START_HANG_GUARD_S, DaemonProcess, wait_until

SMALL = ("--threads", "1", "--n-ctx", "64", "--max-sessions", "2")
KVPOOL = [sys.executable, "-m", "kvpool"]


# ---- a service manager's end of NOTIFY_SOCKET -----------------------------------------------------


class NotifyListener:
    """A bound datagram socket standing in for systemd. Each datagram is recorded with whether a client
    could connect to (and handshake with) `daemon_socket` at the moment it arrived."""

    def __init__(self, address: str, daemon_socket: pathlib.Path) -> None:
        self.address = address
        self.daemon_socket = daemon_socket
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(address))
        self.sock.settimeout(0.2)
        self.datagrams: list[tuple[str, bool]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            message = data.decode()
            answered = self._answers() if "READY=1" in message.splitlines() else False
            self.datagrams.append((message, answered))

    def _answers(self) -> bool:
        try:
            Client(self.daemon_socket, timeout_s=HANG_GUARD_S).close()
        except ConnectionLost:
            return False
        return True

    def lines(self) -> list[str]:
        return [line for message, _ in list(self.datagrams) for line in message.splitlines()]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(HANG_GUARD_S)
        self.sock.close()
        if not self.address.startswith("@"):
            pathlib.Path(self.address).unlink(missing_ok=True)


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


# ---- the notifier alone (no daemon) ---------------------------------------------------------------


def test_notifier_speaks_the_protocol_to_an_abstract_socket():
    name = f"@kvpool-notify-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(socket_address(name))
        manager.settimeout(HANG_GUARD_S)
        notifier = Notifier(name)
        notifier.status("2 workers\nstarted")
        notifier.ready("ready: 2 sessions")
        notifier.stopping()
        notifier.stopping()  # a second signal: not a second STOPPING=1
        notifier.status("after")
        received = [manager.recv(4096) for _ in range(4)]
    assert received == [b"STATUS=2 workers started", b"READY=1\nSTATUS=ready: 2 sessions", b"STOPPING=1\nSTATUS=stopping", b"STATUS=after"]


def test_notifier_without_an_address_sends_nothing_and_a_bad_address_never_raises(caplog):
    silent = Notifier(None)
    assert not silent.enabled
    silent.ready("x")  # no socket is created at all: nothing to observe but no exception
    with caplog.at_level(logging.WARNING, logger="kvpool.serve"):
        for address in ("relative/path", "/nonexistent-dir/notify"):
            notifier = Notifier(address)
            notifier.status("a")
            notifier.ready("b")
            notifier.stopping()
    failures = [record.getMessage() for record in caplog.records if "cannot notify" in record.getMessage()]
    assert len(failures) == 2, failures  # one per notifier, not one per send
    assert "unsupported address" in failures[0] and "No such file or directory" in failures[1]


def test_socket_address_forms():
    assert socket_address("@name") == b"\0name"
    assert socket_address("/run/x") == "/run/x"
    with pytest.raises(ValueError):
        socket_address("vsock:2:1234")


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


def test_wait_ready_gives_up_after_its_timeout_on_a_socket_nobody_serves(socket_dir):
    path = socket_dir / "orphan.sock"
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as orphan:
        orphan.bind(str(path))  # a socket file left by a daemon that died: connections are refused
    started = time.monotonic()
    refused = subprocess.run([*KVPOOL, "status", "--socket", str(path), "--wait-ready", "2"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    waited_s = time.monotonic() - started
    path.unlink()
    assert refused.returncode == 1, refused.stderr
    assert refused.stdout == ""
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"kvpool status: no daemon answered on {path} within 2 s: cannot connect to ") and "Connection refused" in line, line
    assert waited_s >= 2.0  # it did wait its TIMEOUT out (the bound is below; the upper one is the hang guard)


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
def test_wait_ready_timeout_edges(socket_dir, timeout):
    path = socket_dir / "absent.sock"
    result = subprocess.run([*KVPOOL, "status", "--socket", str(path), "--wait-ready", timeout], capture_output=True, text=True, timeout=HANG_GUARD_S)
    if timeout == "0":  # one look, at once
        assert result.returncode == 1 and result.stderr.strip().endswith("within 0 s: no socket there yet"), result.stderr
    else:
        assert result.returncode == 2 and "TIMEOUT must be a number of seconds >= 0" in result.stderr, result.stderr


def test_wait_answering_says_where_it_stands_while_it_waits(socket_dir):
    notes: list[tuple[float, str]] = []
    reason = wait_answering(socket_dir / "never.sock", 0.5, progress_every_s=0.1, progress=lambda waited, why: notes.append((waited, why)))
    assert reason == "no socket there yet"
    assert notes and all(why == "no socket there yet" for _, why in notes)
    assert [waited for waited, _ in notes] == sorted(waited for waited, _ in notes)


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


@pytest.mark.parametrize(
    "text, message",
    [
        ("n-ctx = 128\nmax_sessions = 3\n", "unknown key 'max_sessions' (keys are spelled as the flags, without their dashes: 'max-sessions')"),
        ("n-ctx = 128\nbogus = 1\n", "unknown key 'bogus'"),
        ('n-ctx = "128"\n', "n-ctx must be an integer, not a string ('128')"),
        ("max-sessions = true\n", "max-sessions must be an integer, not a boolean (true)"),
        ("ttl = [1]\n", "ttl must be a number, not an array ([1])"),
        ("flash-attn = 1\n", "flash-attn must be a boolean, not an integer (1)"),
        ('mode = "fast"\n', "mode must be one of process, batched, auto, not 'fast'"),
        ("lifeline-fd = 3\n", "unknown key 'lifeline-fd'"),
        ("[serve]\nn-ctx = 128\n", "unknown key 'serve'"),
        ("n-ctx = \n", "not TOML: "),
    ],
)
def test_config_file_refusals_are_one_line_naming_the_key(socket_dir, text, message):
    config = socket_dir / "bad.toml"
    config.write_text(text)
    refused = subprocess.run([*KVPOOL, "serve", "--config", str(config), "--socket", str(socket_dir / "never.sock")], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert refused.returncode == 2
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"kvpool serve: error: {config}: {message}"), line
    assert not (socket_dir / "never.sock").exists()


def test_config_file_values_as_the_command_line_would_give_them(tmp_path):
    parser = argparse.ArgumentParser()
    serve.define_options(parser)
    options = argparse.ArgumentParser(add_help=False)
    serve.define_options(options)
    keys = file_keys(options)
    config = tmp_path / "serve.toml"
    config.write_text('spill-dir = "spill"\nno-direct = true\nflash-attn = false\nttl = 5\nbudget = "1GiB"\nn-ctx = 256\n')
    merged = with_file(parser.parse_args(["--n-ctx", "512"]), config, keys)
    assert merged.spill_dir == tmp_path / "spill"  # relative to the file
    assert merged.direct is False and merged.flash_attn is False
    assert merged.ttl == 5.0 and isinstance(merged.ttl, float)
    assert merged.budget == "1GiB" and merged.n_ctx == 512  # the flag wins
    built = serve.config_from_args(argparse.Namespace(**{**vars(merged), "spill_dir": None}))
    assert built.budget_bytes == 1024**3 and built.ttl_s == 5.0 and built.direct is False and built.n_ctx == 512
    assert "config" not in keys and "lifeline-fd" not in keys and "help" not in keys
    with pytest.raises(ConfigFileError, match="cannot read"):
        with_file(merged, tmp_path / "absent.toml", keys)


@pytest.fixture
def kvpool_logger():
    """The `kvpool` logger as it was before the test (configure() changes this process's logging)."""
    root = logging.getLogger(logs.ROOT_LOGGER)
    saved = (list(root.handlers), root.level, root.propagate)
    yield logging.getLogger("kvpool.serve")
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]


def test_log_formats(kvpool_logger):
    text, as_json = io.StringIO(), io.StringIO()
    logger = kvpool_logger
    logs.configure("text", stream=text)
    logger.info("ready on %s", "/x.sock")
    logger.warning("kvpool serve: already prefixed")
    logs.configure("json", stream=as_json)  # replaces the text handler
    logger.info("line\nwith a newline", extra={"sessions": 2})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    assert text.getvalue() == "kvpool serve: ready on /x.sock\nkvpool serve: already prefixed\n"
    first, second = [json.loads(line) for line in as_json.getvalue().splitlines()]
    assert first["message"] == "line\nwith a newline" and first["sessions"] == 2 and first["level"] == "info" and first["time"].endswith("+00:00")
    assert second["level"] == "error" and "RuntimeError: boom" in second["traceback"]
    with pytest.raises(ValueError, match="--log-format"):
        logs.configure("xml")

"""Readiness and service managers (issue 20, item 5) without a `kvpool serve` process: the notifier's
sd_notify datagrams, NOTIFY_SOCKET's address forms, READY=1 / STATUS= / STOPPING=1 from a daemon on fake
workers (tests/support/fake_daemon.py), `kvpool status --wait-ready` where no daemon answers, `kvpool serve
--config FILE.toml` refusals and values, and the log formats. What a real `kvpool serve` process does with
NOTIFY_SOCKET from its environment, --wait-ready on a starting daemon and a config file's flags in a running
daemon's log are tests/daemon/test_notify.py's.

Waits are hang guards only; the one short TIMEOUT (2 s) is a test of the timeout path, not of speed.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from kvpool.cli import serve
from kvpool.cli.config_file import ConfigFileError, file_keys, with_file
from kvpool.daemon import logs
from kvpool.daemon.notify import Notifier, socket_address
from kvpool.launcher import wait_answering
from tests.support.daemons import HANG_GUARD_S, wait_until
from tests.support.fake_daemon import FakeDaemon
from tests.support.notify import NotifyListener

KVPOOL = [sys.executable, "-m", "kvpool"]


# ---- a daemon on fake workers and its service manager ---------------------------------------------




def test_ready_only_once_the_socket_answers_then_status_lines_and_stopping_once_on_a_drain(fake_shards, sockets):
    """The supervisor's side of tests/daemon/test_notify.py's first test (which keeps the real process's
    NOTIFY_SOCKET and SIGTERM): READY=1 after the start-up milestones and only once a client can connect;
    STOPPING=1 once, though the drain is asked for twice (the second request stops at once)."""
    daemon_socket = sockets / "notified.sock"
    listener = NotifyListener(f"@kvpool-unit-notify-{os.getpid()}-{id(sockets)}", daemon_socket)
    try:
        daemon = FakeDaemon(fake_shards[0], daemon_socket, notifier=Notifier(listener.address))
        try:
            ready = wait_until(lambda: [d for d in listener.datagrams if "READY=1" in d[0].splitlines()], "READY=1")
            assert ready[0][1], "READY=1 arrived while the daemon's socket did not answer yet"
            lines = listener.lines()
            statuses = [line for line in lines if line.startswith("STATUS=")]
            assert statuses[0] == "STATUS=2 workers started; probing charges", lines
            assert statuses[1].startswith("STATUS=charges probed ("), lines
            assert statuses[2] == f"STATUS=ready on {daemon_socket}: 2 sessions (process mode)", lines
            assert lines.index("READY=1") > lines.index(statuses[1])
            assert "STOPPING=1" not in lines
            with daemon.client() as client:
                assert client.append("s", 1, 0, tokens=[1, 2, 3]).length == 3
        finally:
            daemon.request_drain()
            daemon.request_drain()  # a second SIGTERM: not a second STOPPING=1
            code = daemon.joined()
        assert code in (0, 1), daemon.log()
        wait_until(lambda: "STOPPING=1" in listener.lines(), "STOPPING=1")
        lines = listener.lines()
        assert lines.count("STOPPING=1") == 1 and lines.count("READY=1") == 1, lines
        assert lines.index("STOPPING=1") > lines.index("READY=1")
    finally:
        listener.close()


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


# ---- kvpool status --wait-ready where nothing answers ---------------------------------------------


def test_wait_ready_gives_up_after_its_timeout_on_a_socket_nobody_serves(sockets):
    path = sockets / "orphan.sock"
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
def test_wait_ready_timeout_edges(sockets, timeout):
    path = sockets / "absent.sock"
    result = subprocess.run([*KVPOOL, "status", "--socket", str(path), "--wait-ready", timeout], capture_output=True, text=True, timeout=HANG_GUARD_S)
    if timeout == "0":  # one look, at once
        assert result.returncode == 1 and result.stderr.strip().endswith("within 0 s: no socket there yet"), result.stderr
    else:
        assert result.returncode == 2 and "TIMEOUT must be a number of seconds >= 0" in result.stderr, result.stderr


def test_wait_answering_says_where_it_stands_while_it_waits(sockets):
    notes: list[tuple[float, str]] = []
    reason = wait_answering(sockets / "never.sock", 0.5, progress_every_s=0.1, progress=lambda waited, why: notes.append((waited, why)))
    assert reason == "no socket there yet"
    assert notes and all(why == "no socket there yet" for _, why in notes)
    assert [waited for waited, _ in notes] == sorted(waited for waited, _ in notes)


# ---- kvpool serve --config FILE.toml, --log-format json -------------------------------------------


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
def test_config_file_refusals_are_one_line_naming_the_key(sockets, text, message):
    config = sockets / "bad.toml"
    config.write_text(text)
    refused = subprocess.run([*KVPOOL, "serve", "--config", str(config), "--socket", str(sockets / "never.sock")], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert refused.returncode == 2
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"kvpool serve: error: {config}: {message}"), line
    assert not (sockets / "never.sock").exists()


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
    """The `kvpool` logger as it was before the test (configure() changes this process's logging), and
    `kvpool.serve` at every level meanwhile (tests/support/fake_daemon.py quiets it in this process)."""
    root = logging.getLogger(logs.ROOT_LOGGER)
    serve_logger = logging.getLogger("kvpool.serve")
    saved = (list(root.handlers), root.level, root.propagate, serve_logger.level)
    serve_logger.setLevel(logging.NOTSET)
    yield serve_logger
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
    serve_logger.setLevel(saved[3])


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

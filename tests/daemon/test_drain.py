"""Drain on stop (kvpool.daemon.drain) and the clients' reconnect to the daemon that follows it
(kvpool.client.successor), where a real `kvpool serve` process of the bundled model is what is tested:
`kvpool status --drain` parks a session bound to its direct channel and the daemon exits 0; SIGINT stops at
once without a drain; Clients (one with its direct channel to the old daemon's worker) reach the daemon
started next on the socket; a rolling restart's adopted llama.cpp states continue bit-identically, in both
modes. The drain's contract (draining replies, the timeout, a second request, a full disk, the disk budget,
an interrupted drain, an AsyncClient's reconnect, no resend of a request that may have run) runs on fake
workers: tests/unit/test_drain.py."""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

from kvpool.client.client import Client
from kvpool.daemon.books import spill
from tests.support.daemons import HANG_GUARD_S, STOP_HANG_GUARD_S, DaemonProcess, in_thread, result, stopped, wait_until

N_CTX = 64
PROMPT_TOKENS = 12


def _serve(model_path, socket_path, spill_dir, *options: str) -> DaemonProcess:
    disk = ("--spill-dir", str(spill_dir), "--spill-disk-budget", "64MiB") if spill_dir is not None else ()
    return DaemonProcess(model_path, socket_path, "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "3", *disk, *options)


def _exited(daemon: DaemonProcess) -> int:
    """Its exit status once it has stopped by itself (a hang guard only); then stop()'s checks: no
    worker left, the socket removed."""
    daemon.process.wait(STOP_HANG_GUARD_S)
    return daemon.stop()


def _own_files(spill_dir) -> list[str]:
    return sorted(path.name for path in spill_dir.iterdir() if spill.OWN_FILE.fullmatch(path.name))


def _worker_of(client: Client, session_id: str) -> int:
    return next(row.worker_pid for row in client.stats().sessions if row.session_id == session_id)


def _busy(client: Client, session_id: str) -> bool:
    return any(row.session_id == session_id and row.in_flight for row in client.stats().sessions)


def _in_log(daemon: DaemonProcess, text: str) -> str:
    return wait_until(lambda: text in daemon.log() and daemon.log(), f"{text!r} in the daemon's log")


# ---- `kvpool status --drain` -------------------------------------------------------------------------------


def test_status_drain_parks_the_sessions_and_the_daemon_exits_zero(model_path, socket_dir, tmp_path, prompt_ids):
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    daemon = _serve(model_path, socket_dir / "status.sock", spill_dir)
    try:
        with daemon.client() as client:
            client.append("a", 1, 0, tokens=prompt)
            client.append("a", 1, PROMPT_TOKENS, tokens=[5])  # on the direct channel in process mode
        status = subprocess.run(
            [sys.executable, "-m", "kvpool", "status", "--socket", str(daemon.socket), "--drain"], capture_output=True, text=True, timeout=HANG_GUARD_S,
        )
        assert status.returncode == 0, status.stderr
        assert "drain requested" in status.stderr and "SESSION" in status.stdout
        assert _exited(daemon) == 0
        log = daemon.log()
        assert "drain started: 1 hot and 0 parked sessions, 0 requests in flight, timeout 30 s" in log
        assert "drain done: parked 1 sessions on disk, dropped 0" in log
        assert len(_own_files(spill_dir)) == 1
    finally:
        daemon.stop()


# ---- SIGINT -------------------------------------------------------------------------------------------------


def test_sigint_stops_at_once_without_a_drain_and_keeps_what_was_on_disk(model_path, socket_dir, tmp_path, prompt_ids):
    """An immediate stop loses what was only in memory (the hot session) and keeps what was on disk (the
    parked one, written there at once with --spill-budget 1), as a crash would."""
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    daemon = _serve(model_path, socket_dir / "int.sock", spill_dir, "--spill-budget", "1")
    try:
        with daemon.client() as client:
            client.append("hot", 1, 0, tokens=prompt)
            client.append("parked", 1, 0, tokens=prompt)
            client.park("parked", 1)
            on_disk = {name: (spill_dir / name).read_bytes() for name in _own_files(spill_dir)}
            assert len(on_disk) == 1
        assert daemon.stop(sig=signal.SIGINT) == 0
        assert "drain started" not in daemon.log()
        assert {name: (spill_dir / name).read_bytes() for name in _own_files(spill_dir)} == on_disk
    finally:
        daemon.stop()


# ---- the clients reconnect ----------------------------------------------------------------------------------


def test_clients_whose_daemon_drained_reach_the_next_daemon_on_the_socket(model_path, socket_dir, tmp_path, prompt_ids):
    """A Client that was idle, a Client whose request was answered `draining` while the old daemon drained,
    and an AsyncClient: each request that no daemon took is sent again to the daemon started next on the same
    socket, and succeeds there."""
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    socket_path = socket_dir / "rolling.sock"
    waits: list[str] = []
    old = _serve(model_path, socket_path, spill_dir, "--drain-timeout", "600")
    new = None
    clients: list[Client] = []
    try:
        clients = [
            idle := Client(socket_path),  # direct channel on: its worker goes with the old daemon
            held := Client(socket_path, direct=False),
            resent := Client(socket_path, direct=False, on_successor_wait=waits.append),
        ]
        idle.append("s1", 1, 0, tokens=prompt)
        held.append("held", 1, 0, tokens=prompt)
        with old.client(direct=False) as watcher, stopped(_worker_of(held, "held")):
            in_flight = in_thread(lambda: held.append("held", 1, PROMPT_TOKENS, tokens=[5]))
            wait_until(lambda: _busy(watcher, "held"), "the append in flight")
            old.process.send_signal(signal.SIGTERM)
            _in_log(old, "drain started")
            waiting = in_thread(lambda: resent.append("s3", 1, 0, tokens=prompt))  # answered draining, then sent again
            wait_until(lambda: watcher.stats().counters.get("errors_draining", 0) >= 1, "a draining reply")
            assert waiting[0].is_alive()
        assert result(*in_flight).length == PROMPT_TOKENS + 1  # finished on the old daemon
        assert _exited(old) == 0
        in_the_gap = in_thread(lambda: idle.append("s2", 1, 0, tokens=prompt))  # no daemon on the socket now
        new = _serve(model_path, socket_path, tmp_path / "spill-new")
        first = result(*waiting)
        assert first.admitted and first.length == PROMPT_TOKENS
        second = result(*in_the_gap)
        assert second.admitted and second.length == PROMPT_TOKENS
        assert idle.append("s2", 1, PROMPT_TOKENS, tokens=[6]).length == PROMPT_TOKENS + 1  # and on, as usual
        assert held.append("s5", 1, 0, tokens=prompt).admitted
        assert all("waiting for a daemon on" in line for line in waits)  # every 15 s of the wait, if it took that long
    finally:
        for client in clients:
            client.close()
        if new is not None:
            new.stop()  # first: the old daemon's check is that nothing serves its socket
        old.stop()


@pytest.mark.parametrize("mode", ["process", "batched"])
def test_a_rolling_restart_loses_no_session(model_path, socket_dir, tmp_path, prompt_ids, mode):
    """The drained daemon's parked sessions are adopted by the daemon started next on the same socket and
    spill dir: the client's next append there is restored, bit-identical to a session that never stopped.
    In both modes (batched: the sessions are sequences of one context, their states a stream of it)."""
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    socket_path = socket_dir / f"adopt-{mode}.sock"
    mode_options = ("--mode", mode) + (("--seqs-per-worker", "3") if mode == "batched" else ())
    old = _serve(model_path, socket_path, spill_dir, *mode_options)
    new = None
    try:
        with Client(socket_path) as client:
            client.append("kept", 1, 0, tokens=prompt)
            client.append("also", 1, 0, tokens=prompt[:-3])  # a second sequence in batched mode
            client.shutdown(drain=True)
            assert _exited(old) == 0
            new = _serve(model_path, socket_path, spill_dir, *mode_options)
            adopted = {row.session_id: (row.epoch, row.length, row.tier) for row in client.stats().sessions}
            assert adopted == {"kept": (1, PROMPT_TOKENS, "disk"), "also": (1, PROMPT_TOKENS - 3, "disk")}
            continued = client.append("kept", 1, PROMPT_TOKENS, tokens=[5])
            assert continued.restored and continued.length == PROMPT_TOKENS + 1
            client.append("reference", 1, 0, tokens=prompt)  # the same partition, never parked
            reference = client.append("reference", 1, PROMPT_TOKENS, tokens=[5])
            assert np.array_equal(continued.rows, reference.rows)
    finally:
        if new is not None:
            new.stop()  # first: the old daemon's check is that nothing serves its socket
        old.stop()

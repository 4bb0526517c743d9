"""Drain on stop (kvpool.daemon.drain) and the clients' reconnect to the daemon that follows it
(kvpool.client.successor), on real daemons of the bundled model: SIGTERM and `kvpool status --drain` let the
append in flight finish, answer new work `draining`, park every hot session to the disk tier and exit 0;
--drain-timeout cancels what runs past it; a second signal stops at once; a full disk drops only what does
not fit; a Client and an AsyncClient whose daemon drained reach the daemon started next on the socket."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvpool.client.aio import AsyncClient
from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.daemon.books import spill
from kvpool.daemon.config import ServeConfig
from tests.support.daemons import HANG_GUARD_S, STOP_HANG_GUARD_S, DaemonProcess, in_thread, joined, result, stopped, wait_until
from tests.support.disks import failing_writes

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


def _partial_files(spill_dir) -> list[str]:
    return sorted(path.name for path in spill_dir.iterdir() if path.name.endswith(spill.PARTIAL_SUFFIX))


def _worker_of(client: Client, session_id: str) -> int:
    return next(row.worker_pid for row in client.stats().sessions if row.session_id == session_id)


def _busy(client: Client, session_id: str) -> bool:
    return any(row.session_id == session_id and row.in_flight for row in client.stats().sessions)


def _in_log(daemon: DaemonProcess, text: str) -> str:
    return wait_until(lambda: text in daemon.log() and daemon.log(), f"{text!r} in the daemon's log")


def _refused(call) -> KvpoolError:
    with pytest.raises(KvpoolError) as refused:
        call()
    return refused.value


def test_the_drain_settings_are_checked():
    assert ServeConfig(model="m", socket="/tmp/s", drain_timeout_s=0).drain_timeout_s == 0  # cancel at once: allowed
    with pytest.raises(ValueError, match="--drain-timeout must be >= 0"):
        ServeConfig(model="m", socket="/tmp/s", drain_timeout_s=-0.001)


# ---- SIGTERM, `kvpool status --drain` ---------------------------------------------------------------------


def test_sigterm_finishes_the_append_in_flight_refuses_new_work_and_parks_every_session_on_disk(model_path, socket_dir, tmp_path, prompt_ids):
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    daemon = _serve(model_path, socket_dir / "term.sock", spill_dir, "--drain-timeout", "600")
    try:
        with daemon.client(direct=False) as client, daemon.client(direct=False) as other, daemon.client(successor_wait_s=0) as late:
            for session in ("busy", "idle", "parked"):
                client.append(session, 1, 0, tokens=prompt)
            client.park("parked", 1)
            assert not _own_files(spill_dir)  # parked in memory so far
            with stopped(_worker_of(client, "busy")):
                thread, outcome = in_thread(lambda: client.append("busy", 1, PROMPT_TOKENS, tokens=[5, 6]))
                wait_until(lambda: _busy(other, "busy"), "the append in flight")
                daemon.process.send_signal(signal.SIGTERM)
                log = _in_log(daemon, "drain started")
                assert "drain started: 2 hot and 1 parked sessions, 1 requests in flight, timeout 600 s" in log
                new = _refused(lambda: late.append("new", 1, 0, tokens=prompt))  # a new session: not admitted
                assert new.code == "draining" and new.reply.retry_after_s > 0
                restore = _refused(lambda: late.append("parked", 1, PROMPT_TOKENS, tokens=[7]))  # nor a restore
                assert restore.code == "draining"
                assert _refused(lambda: late.truncate("idle", 1, 3)).code == "draining"  # nor any other change
                stats = other.stats()  # answered while draining
                assert stats.counters["drains"] == 1 and stats.counters["errors_draining"] == 3
                assert {row.session_id: row.length for row in stats.sessions} == {"busy": PROMPT_TOKENS, "idle": PROMPT_TOKENS, "parked": PROMPT_TOKENS}
            appended = result(thread, outcome)  # the append in flight finished, and its reply came back
            assert appended.length == PROMPT_TOKENS + 2 and appended.rows.shape[0] == 1
        assert _exited(daemon) == 0
        log = daemon.log()
        assert "drain done: parked 3 sessions on disk, dropped 0, cancelled 0 appends past the timeout" in log
        assert "books: ok" in log and "Traceback" not in log
        assert len(_own_files(spill_dir)) == 3 and not _partial_files(spill_dir)  # every session outlasts the process
    finally:
        daemon.stop()


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


def test_status_refuses_shutdown_and_drain_together(socket_dir):
    status = subprocess.run(
        [sys.executable, "-m", "kvpool", "status", "--socket", str(socket_dir / "none.sock"), "--drain", "--shutdown"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert status.returncode == 2 and "not allowed with argument" in status.stderr


# ---- the timeout, a second signal ---------------------------------------------------------------------------


def test_an_append_running_past_the_drain_timeout_is_cancelled_and_the_drain_completes(model_path, socket_dir, tmp_path, prompt_ids):
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    daemon = _serve(model_path, socket_dir / "timeout.sock", spill_dir, "--drain-timeout", "0.5")
    try:
        with daemon.client(direct=False) as client, daemon.client(direct=False) as other:
            client.append("slow", 1, 0, tokens=prompt)
            client.append("quick", 1, 0, tokens=prompt)
            with stopped(_worker_of(client, "slow")):  # its append cannot finish before the timeout, on any machine
                thread, outcome = in_thread(lambda: client.append("slow", 1, PROMPT_TOKENS, tokens=prompt))
                wait_until(lambda: _busy(other, "slow"), "the append in flight")
                daemon.process.send_signal(signal.SIGTERM)
                _in_log(daemon, "drain: 1 requests still in flight after 0.5 s: cancelling 1 appends")
            joined(thread, outcome)
            cancelled = outcome["error"]
            assert isinstance(cancelled, KvpoolError) and cancelled.code == "cancelled" and cancelled.length == PROMPT_TOKENS
        assert _exited(daemon) == 0
        log = daemon.log()
        assert "drain done: parked 2 sessions on disk, dropped 0, cancelled 1 appends past the timeout" in log and "books: ok" in log
        assert len(_own_files(spill_dir)) == 2
    finally:
        daemon.stop()


def test_a_second_sigterm_during_the_drain_stops_at_once(model_path, socket_dir, tmp_path, prompt_ids):
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    daemon = _serve(model_path, socket_dir / "twice.sock", spill_dir, "--drain-timeout", "600")
    try:
        with daemon.client(direct=False) as client, daemon.client(direct=False) as other:
            client.append("held", 1, 0, tokens=prompt)
            client.append("idle", 1, 0, tokens=prompt)
            with stopped(_worker_of(client, "held")):
                thread, outcome = in_thread(lambda: client.append("held", 1, PROMPT_TOKENS, tokens=[5]))
                wait_until(lambda: _busy(other, "held"), "the append in flight")
                daemon.process.send_signal(signal.SIGTERM)
                _in_log(daemon, "drain started")
                daemon.process.send_signal(signal.SIGTERM)  # the drain would wait 600 s for the held append
                _in_log(daemon, "stop requested during the drain: stopping at once (exit status 1)")
            joined(thread, outcome)
        assert _exited(daemon) == 1
        log = daemon.log()
        assert "drain done: parked 0 sessions on disk" in log and "kvpool serve: stopped" in log
        assert not _own_files(spill_dir)  # cut short before it parked anything: both sessions were only in memory
    finally:
        daemon.stop()


def test_an_interrupted_drain_keeps_the_files_it_adopted_and_the_next_daemon_adopts_them(model_path, socket_dir, tmp_path, prompt_ids):
    """A stop may lose what it had not yet written, never what was already safe on disk: the states a
    daemon adopted from the run before and never touched outlast a drain cut short by a second SIGTERM (as
    they would a SIGKILL at that moment), and the daemon after it adopts them."""
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "spill"
    socket_path = socket_dir / "kept.sock"
    daemons: list[DaemonProcess] = []
    try:
        daemons.append(first := _serve(model_path, socket_path, spill_dir))
        with first.client() as client:
            for session in ("a", "b"):
                client.append(session, 1, 0, tokens=prompt)
        first.process.send_signal(signal.SIGTERM)
        assert _exited(first) == 0
        saved = {name: (spill_dir / name).read_bytes() for name in _own_files(spill_dir)}
        assert len(saved) == 2

        daemons.append(second := _serve(model_path, socket_path, spill_dir, "--drain-timeout", "600"))
        with second.client(direct=False) as client, second.client(direct=False) as other:
            assert {row.session_id: row.tier for row in client.stats().sessions} == {"a": "disk", "b": "disk"}
            client.append("held", 1, 0, tokens=prompt)
            with stopped(_worker_of(client, "held")):
                thread, outcome = in_thread(lambda: client.append("held", 1, PROMPT_TOKENS, tokens=[5]))
                wait_until(lambda: _busy(other, "held"), "the append in flight")
                second.process.send_signal(signal.SIGTERM)
                _in_log(second, "drain started")  # it waits for the held append: the drain is in progress
                second.process.send_signal(signal.SIGTERM)
                _in_log(second, "stop requested during the drain: stopping at once (exit status 1)")
            joined(thread, outcome)
        assert _exited(second) == 1
        assert {name: (spill_dir / name).read_bytes() for name in _own_files(spill_dir)} == saved  # "held" was only in memory

        daemons.append(third := _serve(model_path, socket_path, spill_dir))
        with third.client() as client:
            assert {row.session_id: (row.length, row.tier) for row in client.stats().sessions} == {"a": (PROMPT_TOKENS, "disk"), "b": (PROMPT_TOKENS, "disk")}
            continued = client.append("a", 1, PROMPT_TOKENS, tokens=[5])
            client.append("reference", 1, 0, tokens=prompt)
            assert continued.restored and np.array_equal(continued.rows, client.append("reference", 1, PROMPT_TOKENS, tokens=[5]).rows)
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


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


# ---- a full disk ------------------------------------------------------------------------------------------------


def test_a_full_disk_during_the_drain_drops_what_does_not_fit_and_leaves_no_partial_file(model_path, socket_dir, tmp_path, prompt_ids):
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    spill_dir = tmp_path / "full"
    with failing_writes(spill_dir) as break_writes:
        daemon = _serve(model_path, socket_dir / "full.sock", spill_dir)
        try:
            with daemon.client() as client:
                for session in ("a", "b"):
                    client.append(session, 1, 0, tokens=prompt)
            break_writes()
            daemon.process.send_signal(signal.SIGTERM)
            assert _exited(daemon) == 0
            log = daemon.log()
            assert "drain done: parked 0 sessions on disk, dropped 2 (2 dropped: their disk write failed)" in log
            assert "books: ok" in log and "spill disk tier: writing" in log
            assert not _own_files(spill_dir) and not _partial_files(spill_dir)
        finally:
            daemon.stop()


def test_a_small_disk_budget_keeps_the_newest_states_and_drops_the_rest_with_a_log_line(model_path, socket_dir, tmp_path, prompt_ids):
    """The disk budget holds two of the three sessions' states: the drain writes them oldest first, so the
    oldest is pushed out for the newest (the store's rule), and the books balance."""
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    probe_dir = tmp_path / "probe"
    daemon = _serve(model_path, socket_dir / "probe.sock", probe_dir)
    try:
        with daemon.client() as client:
            client.append("probe", 1, 0, tokens=prompt)
            client.park("probe", 1)
            blob_bytes = client.stats().budget.spill_bytes
    finally:
        daemon.stop(sig=signal.SIGINT)
    spill_dir = tmp_path / "small"
    daemon = _serve(model_path, socket_dir / "small.sock", None, "--spill-dir", str(spill_dir), "--spill-disk-budget", str(blob_bytes * 2 + blob_bytes // 2))
    try:
        with daemon.client() as client:
            for session in ("oldest", "middle", "newest"):
                client.append(session, 1, 0, tokens=prompt)
        daemon.process.send_signal(signal.SIGTERM)
        assert _exited(daemon) == 0
        log = daemon.log()
        assert "drain done: parked 2 sessions on disk, dropped 1 (1 dropped: no room in --spill-disk-budget)" in log and "books: ok" in log
        assert len(_own_files(spill_dir)) == 2 and not _partial_files(spill_dir)
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


def test_an_async_client_whose_daemon_drained_reaches_the_next_daemon(model_path, socket_dir, tmp_path, prompt_ids):
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    socket_path = socket_dir / "async.sock"
    old = _serve(model_path, socket_path, tmp_path / "spill")
    holder: dict[str, DaemonProcess] = {}
    try:
        async def run():
            async with AsyncClient(socket_path) as client:
                assert (await client.append("a", 1, 0, tokens=prompt)).admitted
                await client.shutdown(drain=True)
                await asyncio.to_thread(_exited, old)
                # no daemon on the socket now: this request waits for the next one, started meanwhile
                later = asyncio.create_task(client.append("b", 1, 0, tokens=prompt))
                holder["new"] = await asyncio.to_thread(_serve, model_path, socket_path, tmp_path / "spill-new")
                return await later

        got = asyncio.run(run())
        assert got.admitted and got.length == PROMPT_TOKENS
        assert old.exit_code == 0
    finally:
        if "new" in holder:
            holder["new"].stop()
        old.stop()


def test_a_request_that_may_have_run_is_never_sent_again(model_path, socket_dir, tmp_path, prompt_ids):
    """An append in flight when its daemon stops at once (SIGINT: no drain, no farewell): its reply is lost
    and it may have taken effect, so the client raises ConnectionLost, as before drains existed."""
    prompt = prompt_ids[0][:PROMPT_TOKENS]
    daemon = _serve(model_path, socket_dir / "lost.sock", None)
    try:
        with daemon.client(direct=False) as client, daemon.client(direct=False) as watcher:
            client.append("a", 1, 0, tokens=prompt)
            with stopped(_worker_of(client, "a")):
                thread, outcome = in_thread(lambda: client.append("a", 1, PROMPT_TOKENS, tokens=[5]))
                wait_until(lambda: _busy(watcher, "a"), "the append in flight")
                daemon.process.send_signal(signal.SIGINT)
                _in_log(daemon, "shutting down")
            joined(thread, outcome)
            assert isinstance(outcome.get("error"), (ConnectionLost, KvpoolError))
            with pytest.raises(ConnectionLost):  # no daemon, and none was announced: at once, as before
                client.stats()
    finally:
        daemon.stop()


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

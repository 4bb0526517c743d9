"""Drain on stop (kvpool.daemon.drain) and the clients' reconnect to the daemon that follows it
(kvpool.client.successor), on daemons of fake workers (tests/support/fake_daemon.py): a drain (what SIGTERM
and `kvpool status --drain` ask for: FakeDaemon.request_drain) lets the append in flight finish, answers new
work `draining`, parks every hot session to the disk tier and exits 0; --drain-timeout cancels what runs past
it; a second request stops at once; a full disk drops only what does not fit; an AsyncClient whose daemon
drained reaches the daemon started next on the socket; a request that may have run is never sent again.

What needs a `kvpool serve` process (SIGINT, `kvpool status --drain` on a session bound to its direct
channel, a Client whose direct channel went with the old daemon, llama.cpp states adopted and restored
exactly) stays in tests/daemon/test_drain.py."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import numpy as np
import pytest

from kvpool.client.aio import AsyncClient
from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.client.messages import park_call
from kvpool.daemon.books import spill
from kvpool.daemon.config import ServeConfig
from tests.support.daemons import HANG_GUARD_S, in_thread, joined, result, wait_until
from tests.support.disks import failing_writes
from tests.support.fake_worker import expected_rows

N_CTX = 64
PROMPT_TOKENS = 12
PROMPT = [(5 * index + 3) % 256 for index in range(PROMPT_TOKENS)]


def _serve(serve, model, spill_dir, *options: str, name: str = "d"):
    disk = ("--spill-dir", str(spill_dir), "--spill-disk-budget", "64MiB") if spill_dir is not None else ()
    return serve(model, "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "3", *disk, *options, name=name)


def _own_files(spill_dir) -> list[str]:
    return sorted(path.name for path in spill_dir.iterdir() if spill.OWN_FILE.fullmatch(path.name))


def _partial_files(spill_dir) -> list[str]:
    return sorted(path.name for path in spill_dir.iterdir() if path.name.endswith(spill.PARTIAL_SUFFIX))


def _busy(client: Client, session_id: str) -> bool:
    return any(row.session_id == session_id and row.in_flight for row in client.stats().sessions)


def _in_log(daemon, text: str) -> str:
    return wait_until(lambda: text in daemon.log() and daemon.log(), f"{text!r} in the daemon's log")


def _refused(call) -> KvpoolError:
    with pytest.raises(KvpoolError) as refused:
        call()
    return refused.value


def _errors(caplog) -> list[str]:
    """What the daemon logged at ERROR or above (a `kvpool serve` process prints it with its traceback)."""
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


def _rows(client, history: list[int]) -> np.ndarray:
    return expected_rows(client.hello.shard.shape, np.asarray(history, np.int32))


def test_the_drain_settings_are_checked():
    assert ServeConfig(model="m", socket="/tmp/s", drain_timeout_s=0).drain_timeout_s == 0  # cancel at once: allowed
    with pytest.raises(ValueError, match="--drain-timeout must be >= 0"):
        ServeConfig(model="m", socket="/tmp/s", drain_timeout_s=-0.001)


# ---- a drain (SIGTERM, `kvpool status --drain`) ------------------------------------------------------------


def test_sigterm_finishes_the_append_in_flight_refuses_new_work_and_parks_every_session_on_disk(serve, fake_model, tmp_path, caplog):
    prompt = PROMPT
    spill_dir = tmp_path / "spill"
    daemon = _serve(serve, fake_model, spill_dir, "--drain-timeout", "600")
    with daemon.client() as client, daemon.client() as other, daemon.client(successor_wait_s=0) as late:
        for session in ("busy", "idle", "parked"):
            client.append(session, 1, 0, tokens=prompt)
        client.park("parked", 1)
        assert not _own_files(spill_dir)  # parked in memory so far
        with daemon.stopped("busy"):
            thread, outcome = in_thread(lambda: client.append("busy", 1, PROMPT_TOKENS, tokens=[5, 6]))
            wait_until(lambda: _busy(other, "busy"), "the append in flight")
            daemon.request_drain()  # what SIGTERM calls
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
        assert np.array_equal(appended.rows, _rows(client, prompt + [5, 6]))
    assert daemon.joined() == 0
    log = daemon.log()
    assert "drain done: parked 3 sessions on disk, dropped 0, cancelled 0 appends past the timeout" in log
    assert "books: ok" in log and not _errors(caplog)
    assert len(_own_files(spill_dir)) == 3 and not _partial_files(spill_dir)  # every session outlasts the daemon


def test_status_refuses_shutdown_and_drain_together(sockets):
    status = subprocess.run(
        [sys.executable, "-m", "kvpool", "status", "--socket", str(sockets / "none.sock"), "--drain", "--shutdown"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert status.returncode == 2 and "not allowed with argument" in status.stderr


# ---- the timeout, a second request ----------------------------------------------------------------------


def test_an_append_running_past_the_drain_timeout_is_cancelled_and_the_drain_completes(serve, fake_model, tmp_path):
    prompt = PROMPT
    spill_dir = tmp_path / "spill"
    daemon = _serve(serve, fake_model, spill_dir, "--drain-timeout", "0.5")
    with daemon.client() as client, daemon.client() as other:
        client.append("slow", 1, 0, tokens=prompt)
        client.append("quick", 1, 0, tokens=prompt)
        with daemon.stopped("slow"):  # its append cannot finish before the timeout, on any machine
            thread, outcome = in_thread(lambda: client.append("slow", 1, PROMPT_TOKENS, tokens=prompt))
            wait_until(lambda: _busy(other, "slow"), "the append in flight")
            daemon.request_drain()
            _in_log(daemon, "drain: 1 requests still in flight after 0.5 s: cancelling 1 appends")
        joined(thread, outcome)
        cancelled = outcome["error"]
        assert isinstance(cancelled, KvpoolError) and cancelled.code == "cancelled" and cancelled.length == PROMPT_TOKENS
    assert daemon.joined() == 0
    log = daemon.log()
    assert "drain done: parked 2 sessions on disk, dropped 0, cancelled 1 appends past the timeout" in log and "books: ok" in log
    assert len(_own_files(spill_dir)) == 2


def test_a_second_sigterm_during_the_drain_stops_at_once(serve, fake_model, tmp_path):
    prompt = PROMPT
    spill_dir = tmp_path / "spill"
    daemon = _serve(serve, fake_model, spill_dir, "--drain-timeout", "600")
    with daemon.client() as client, daemon.client() as other:
        client.append("held", 1, 0, tokens=prompt)
        client.append("idle", 1, 0, tokens=prompt)
        with daemon.stopped("held"):
            thread, outcome = in_thread(lambda: client.append("held", 1, PROMPT_TOKENS, tokens=[5]))
            wait_until(lambda: _busy(other, "held"), "the append in flight")
            daemon.request_drain()
            _in_log(daemon, "drain started")
            daemon.request_drain()  # the drain would wait 600 s for the held append
            _in_log(daemon, "stop requested during the drain: stopping at once (exit status 1)")
        joined(thread, outcome)
    assert daemon.joined() == 1
    log = daemon.log()
    assert "drain done: parked 0 sessions on disk" in log and daemon.lines[-1] == "stopped"
    assert not _own_files(spill_dir)  # cut short before it parked anything: both sessions were only in memory


def test_an_interrupted_drain_keeps_the_files_it_adopted_and_the_next_daemon_adopts_them(serve, fake_model, tmp_path):
    """A stop may lose what it had not yet written, never what was already safe on disk: the states a
    daemon adopted from the run before and never touched outlast a drain cut short by a second request (as
    they would a crash at that moment), and the daemon after it adopts them."""
    prompt = PROMPT
    spill_dir = tmp_path / "spill"
    first = _serve(serve, fake_model, spill_dir, name="kept")
    with first.client() as client:
        for session in ("a", "b"):
            client.append(session, 1, 0, tokens=prompt)
    assert first.drain() == 0
    saved = {name: (spill_dir / name).read_bytes() for name in _own_files(spill_dir)}
    assert len(saved) == 2

    second = _serve(serve, fake_model, spill_dir, "--drain-timeout", "600", name="kept")
    with second.client() as client, second.client() as other:
        assert {row.session_id: row.tier for row in client.stats().sessions} == {"a": "disk", "b": "disk"}
        client.append("held", 1, 0, tokens=prompt)
        with second.stopped("held"):
            thread, outcome = in_thread(lambda: client.append("held", 1, PROMPT_TOKENS, tokens=[5]))
            wait_until(lambda: _busy(other, "held"), "the append in flight")
            second.request_drain()
            _in_log(second, "drain started")  # it waits for the held append: the drain is in progress
            second.request_drain()
            _in_log(second, "stop requested during the drain: stopping at once (exit status 1)")
        joined(thread, outcome)
    assert second.joined() == 1
    assert {name: (spill_dir / name).read_bytes() for name in _own_files(spill_dir)} == saved  # "held" was only in memory

    third = _serve(serve, fake_model, spill_dir, name="kept")
    with third.client() as client:
        assert {row.session_id: (row.length, row.tier) for row in client.stats().sessions} == {"a": (PROMPT_TOKENS, "disk"), "b": (PROMPT_TOKENS, "disk")}
        continued = client.append("a", 1, PROMPT_TOKENS, tokens=[5])
        client.append("reference", 1, 0, tokens=prompt)
        assert continued.restored and np.array_equal(continued.rows, client.append("reference", 1, PROMPT_TOKENS, tokens=[5]).rows)
        assert np.array_equal(continued.rows, _rows(client, prompt + [5]))


# ---- a full disk ------------------------------------------------------------------------------------------------


def test_a_full_disk_during_the_drain_drops_what_does_not_fit_and_leaves_no_partial_file(serve, fake_model, tmp_path, caplog):
    prompt = PROMPT
    spill_dir = tmp_path / "full"
    with failing_writes(spill_dir) as break_writes:
        daemon = _serve(serve, fake_model, spill_dir)
        with daemon.client() as client:
            for session in ("a", "b"):
                client.append(session, 1, 0, tokens=prompt)
        break_writes()
        with caplog.at_level(logging.WARNING, logger="kvpool.serve"):
            assert daemon.drain() == 0
        log = daemon.log()
        assert "drain done: parked 0 sessions on disk, dropped 2 (2 dropped: their disk write failed)" in log
        assert "books: ok" in log and any("spill disk tier: writing" in record.getMessage() for record in caplog.records)
        assert not _own_files(spill_dir) and not _partial_files(spill_dir)


def test_a_small_disk_budget_keeps_the_newest_states_and_drops_the_rest_with_a_log_line(serve, fake_model, tmp_path):
    """The disk budget holds two of the three sessions' states: the drain writes them oldest first, so the
    oldest is pushed out for the newest (the store's rule), and the books balance."""
    prompt = PROMPT
    probe = _serve(serve, fake_model, tmp_path / "probe", name="probe")
    with probe.client() as client:
        client.append("probe", 1, 0, tokens=prompt)
        client.park("probe", 1)
        blob_bytes = client.stats().budget.spill_bytes
    probe.stop()  # at once, as SIGINT
    spill_dir = tmp_path / "small"
    daemon = _serve(serve, fake_model, None, "--spill-dir", str(spill_dir), "--spill-disk-budget", str(blob_bytes * 2 + blob_bytes // 2), name="small")
    with daemon.client() as client:
        for session in ("oldest", "middle", "newest"):
            client.append(session, 1, 0, tokens=prompt)
    assert daemon.drain() == 0
    log = daemon.log()
    assert "drain done: parked 2 sessions on disk, dropped 1 (1 dropped: no room in --spill-disk-budget)" in log and "books: ok" in log
    assert len(_own_files(spill_dir)) == 2 and not _partial_files(spill_dir)


# ---- the clients reconnect ----------------------------------------------------------------------------------


def test_an_async_client_whose_daemon_drained_reaches_the_next_daemon(serve, fake_model, tmp_path):
    prompt = PROMPT
    old = _serve(serve, fake_model, tmp_path / "spill", name="async")
    codes: list[int] = []

    async def run():
        async with AsyncClient(old.socket) as client:
            assert (await client.append("a", 1, 0, tokens=prompt)).admitted
            await client.shutdown(drain=True)
            codes.append(await asyncio.to_thread(old.joined))
            # no daemon on the socket now: this request waits for the next one, started meanwhile
            later = asyncio.create_task(client.append("b", 1, 0, tokens=prompt))
            await asyncio.to_thread(_serve, serve, fake_model, tmp_path / "spill-new", name="async")
            return await later

    got = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
    assert got.admitted and got.length == PROMPT_TOKENS
    assert codes == [0]


def test_a_request_that_may_have_run_is_never_sent_again(serve, fake_model):
    """An append in flight when its daemon stops at once (SIGINT, Shutdown{}: no drain, no farewell): its reply
    is lost and it may have taken effect, so the client raises ConnectionLost, as before drains existed."""
    prompt = PROMPT
    daemon = _serve(serve, fake_model, None)
    with daemon.client() as client, daemon.client() as watcher:
        client.append("a", 1, 0, tokens=prompt)
        with daemon.stopped("a"):
            thread, outcome = in_thread(lambda: client.append("a", 1, PROMPT_TOKENS, tokens=[5]))
            wait_until(lambda: _busy(watcher, "a"), "the append in flight")
            daemon.request_stop()  # what SIGINT calls
            _in_log(daemon, "shutting down")
        joined(thread, outcome)
        assert isinstance(outcome.get("error"), (ConnectionLost, KvpoolError))
        with pytest.raises(ConnectionLost):  # no daemon, and none was announced: at once, as before
            client.stats()
    daemon.joined()


def test_a_drain_waits_for_the_save_of_a_park_answered_before_it(serve, fake_model, tmp_path):
    spill_dir = tmp_path / "spill"
    daemon = _serve(serve, fake_model, spill_dir, "--drain-timeout", "600")
    with daemon.client() as client:
        client.append("s", 1, 0, tokens=PROMPT)
        with daemon.stopped("s"):  # the save cannot complete inside the block
            assert client.park("s", 1, wait=False).detail == "parking"
            daemon.request_drain()
            _in_log(daemon, "drain started")
            time.sleep(0.5)  # longer than the drain's tries at a busy session (3 x 50 ms): it must wait for the save itself
    assert daemon.joined() == 0
    assert "drain done: parked 1 sessions on disk, dropped 0" in daemon.log()
    assert len(_own_files(spill_dir)) == 1


def test_ask_all_sends_a_request_its_drained_daemon_never_took_to_the_daemon_after_it(serve, fake_model, tmp_path):
    spill_dir = tmp_path / "spill"
    old = _serve(serve, fake_model, spill_dir, name="fan")
    with old.client() as client:
        client.append("a", 1, 0, tokens=PROMPT)
        client.shutdown(drain=True)
        assert old.joined() == 0  # "a" parked on disk; no daemon on the socket now
        thread, outcome = in_thread(lambda: Client.ask_all([(client, park_call("a", 1))]))
        _serve(serve, fake_model, spill_dir, name="fan")  # the next daemon, which adopts "a"
        (answer,) = result(thread, outcome)
        assert answer.detail == "already parked" and answer.length == PROMPT_TOKENS

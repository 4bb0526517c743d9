"""The daemon contract, end to end: real `kvpool serve` processes on real shards of the bundled model."""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time
import urllib.request

import numpy as np
import psutil
import pytest

from kvpool.client.client import KvpoolError
from kvpool.daemon.admission.admission import MAX_ADMIT_WAIT_S
from kvpool.router.route import Route
from kvpool.router.router import Router
from kvpool.wire.framing import FRAME_HEADER
from kvpool.wire.protocol import PROTOCOL_VERSION, Append, AppendReply, Done, Hello, Release, Stats, encode
from tests.support.chains import daemon_chain, greedy_with_logits, release_all
from tests.support.daemons import STOP_HANG_GUARD_S, DaemonProcess, exited_all, raw_connection, read_reply, sent_and_read
from tests.support.daemons import in_thread as _in_thread
from tests.support.daemons import joined as _joined
from tests.support.daemons import result as _result
from tests.support.daemons import stopped as _stopped
from tests.support.daemons import wait_until as _wait_until

N_CTX = 512
GREEDY = 16
# Hang guards only: every wait below is for an event that takes well under a second on 2 quiet cores.
# No test here passes or fails on how fast the machine is; these only stop a hung daemon hanging the suite.
HANG_GUARD_S = 600.0
pytestmark = pytest.mark.timeout(3600)  # the slowest test takes ~15 s on 2 cores with two CPU burners beside it


@pytest.fixture(scope="module")
def chain_daemon_processes(shards, socket_dir):
    """Three daemons, one per shard of the even split, 4 workers each, one compute thread each."""
    with daemon_chain([shard.path for shard in shards], socket_dir, "chain", "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "4",
                      "--calibration-cache", "off") as daemons:  # each start probes: the calibration test reads it
        yield daemons


@pytest.fixture
def chain_daemons(chain_daemon_processes):
    """The shared chain, with no sessions left over from an earlier test (checked again after)."""
    release_all(chain_daemon_processes)
    yield chain_daemon_processes
    release_all(chain_daemon_processes)


@pytest.fixture(params=["direct", "supervisor"])
def route(request, chain_daemons):
    """One walk per call, no recovery: the contract's errors reach the test. Run twice: appends of bound
    sessions over the workers' direct channels (the client's default), and every request through the daemon."""
    clients = [daemon.client(direct=request.param == "direct") for daemon in chain_daemons]
    walk = Route(clients)
    walk.name = request.param  # session ids differ between the two runs: the daemons remember epochs
    yield walk
    for client in clients:
        client.close()


def _alone(local_chain, prompt, count=GREEDY, chunk=0):
    """Tokens and chosen-from logits of the same run, alone, in process (the reference)."""
    with local_chain.new_session(N_CTX) as session:
        return greedy_with_logits(session.append, prompt, count, prefill_chunk=chunk)


def _through(clients, session_id, epoch, prompt, count=GREEDY, chunk=0):
    """The same run through the daemons, as kvpool.router.router walks it."""
    session = Router(clients).session(session_id, epoch=epoch)
    return greedy_with_logits(session.append_at, prompt, count, prefill_chunk=chunk)


def _reserved(daemon) -> int:
    with daemon.client() as client:
        return client.stats().budget.reserved_bytes


# ---- the contract ---------------------------------------------------------------------------------


def test_prefill_and_decode_through_three_daemons_equal_the_in_process_chain(route, local_chain, chain_daemons, prompt_ids):
    prompt = prompt_ids[1]
    expected_tokens, expected_logits = _alone(local_chain, prompt, chunk=7)
    tokens, logits = _through(route.clients, "prefill-decode", 1, prompt, chunk=7)
    assert tokens == expected_tokens
    assert np.abs(logits - expected_logits).max() == 0.0
    for daemon in chain_daemons:
        with daemon.client() as client:
            rows = client.stats().sessions
            assert [(r.session_id, r.epoch, r.length) for r in rows] == [("prefill-decode", 1, len(prompt) + GREEDY)]
    release_all(chain_daemons)


def test_each_session_epoch_maps_to_its_own_context(route, chain_daemons, prompt_ids):
    route.append("iso-a", 1, 0, prompt_ids[0])
    route.append("iso-b", 1, 0, prompt_ids[1])
    for daemon in chain_daemons:
        with daemon.client() as client:
            stats = client.stats()
        rows = {row.session_id: row for row in stats.sessions}
        assert rows["iso-a"].length == len(prompt_ids[0]) and rows["iso-b"].length == len(prompt_ids[1])
        assert rows["iso-a"].worker_pid != rows["iso-b"].worker_pid  # separate processes
        assert stats.budget.reserved_bytes == rows["iso-a"].charged_bytes + rows["iso-b"].charged_bytes
    release_all(chain_daemons)


def test_every_reply_carries_the_length_and_positions_are_checked(chain_daemons, prompt_ids):
    prompt = prompt_ids[0]
    with chain_daemons[0].client() as client:
        assert client.append("pos", 1, 0, tokens=prompt[:5]).length == 5
        with pytest.raises(KvpoolError) as gap:
            client.append("pos", 1, 6, tokens=prompt[5:7])
        assert gap.value.code == "position_mismatch" and gap.value.length == 5
        with pytest.raises(KvpoolError) as overlap:
            client.append("pos", 1, 4, tokens=prompt[5:7])
        assert overlap.value.code == "position_mismatch" and overlap.value.length == 5
        assert client.append("pos", 1, 5, tokens=prompt[5:7]).length == 7
        assert client.truncate("pos", 1, 3) == 3
        with pytest.raises(KvpoolError) as beyond:
            client.truncate("pos", 1, 4)
        assert beyond.value.code == "position_mismatch" and beyond.value.length == 3
        assert client.release("pos", 1).length == 0
    release_all(chain_daemons)


def test_truncate_then_continue_equals_a_fresh_run(route, local_chain, chain_daemons, prompt_ids):
    prompt = prompt_ids[1]
    keep = len(prompt) - 4
    route.append("trunc", 1, 0, prompt)
    route.append("trunc", 1, len(prompt), [11, 12, 13])
    route.truncate("trunc", 1, keep)
    logits = route.append("trunc", 1, keep, prompt_ids[0][:6])
    with local_chain.new_session(N_CTX) as fresh:
        fresh.append(0, prompt[:keep])
        expected = fresh.append(keep, prompt_ids[0][:6])
    assert np.abs(logits - expected).max() == 0.0
    release_all(chain_daemons)


def _counts(daemons, *names: str) -> list[tuple[int, ...]]:
    stats = []
    for daemon in daemons:
        with daemon.client() as client:
            counters = client.stats().counters
        stats.append(tuple(counters.get(name, 0) for name in names))
    return stats


def test_a_parked_route_restored_on_every_daemon_at_once_continues_exactly(route, local_chain, chain_daemons, prompt_ids):
    prompt = prompt_ids[1]
    with local_chain.new_session(N_CTX) as alone:
        expected = [alone.append(0, prompt), alone.append(len(prompt), [100]), alone.append(len(prompt) + 1, [101])]
    assert np.abs(route.append("restore", 1, 0, prompt) - expected[0]).max() == 0.0
    assert [done.detail for done in route.park("restore", 1, wait=False)] == ["parking"] * 3
    before = _counts(chain_daemons, "restores", "restore_requests", "direct_appends")
    restored = route.restore("restore", 1)  # each waits for its save behind the park's answer, then restores
    assert [(done.detail, done.length) for done in restored] == [("restored", len(prompt))] * 3
    assert [bool(done.channel) for done in restored] == [route.name == "direct"] * 3  # bound only for a client that asks
    result = route.append_at(0, "restore", 1, len(prompt), [100])
    assert not result.restored  # hot already: the append computed at once
    rows = result.rows
    for stage in (1, 2):
        result = route.append_at(stage, "restore", 1, len(prompt), rows)
        assert not result.restored
        rows = result.rows
    assert np.abs(rows - expected[1]).max() == 0.0
    after = _counts(chain_daemons, "restores", "restore_requests", "direct_appends")
    direct = int(route.name == "direct")
    assert [tuple(a - b for a, b in zip(later, earlier)) for later, earlier in zip(after, before)] == [(1, 1, direct)] * 3
    assert [done.detail for done in route.restore("restore", 1)] == ["hot"] * 3  # as it is, its channel bound again
    assert np.abs(route.append("restore", 1, len(prompt) + 1, [101]) - expected[2]).max() == 0.0
    assert [tuple(a - b for a, b in zip(later, earlier)) for later, earlier in zip(_counts(chain_daemons, "restores", "restore_requests", "direct_appends"), after)] == [(0, 0, direct)] * 3
    release_all(chain_daemons)


def test_release_is_idempotent_returns_bytes_and_later_appends_miss(route, local_chain, chain_daemons, prompt_ids):
    other_prompt = prompt_ids[0]
    expected_tokens, expected_logits = _alone(local_chain, other_prompt)
    route.append("keep", 1, 0, other_prompt[:6])
    route.append("gone", 1, 0, prompt_ids[1])
    before = [_reserved(daemon) for daemon in chain_daemons]
    route.release("gone", 1)
    route.release("gone", 1)  # idempotent
    after = [_reserved(daemon) for daemon in chain_daemons]
    assert all(a < b for a, b in zip(after, before))
    with pytest.raises(KvpoolError) as miss:
        route.append("gone", 1, len(prompt_ids[1]), [5])
    assert miss.value.code == "cache_miss" and miss.value.reason == "released" and miss.value.length == 0
    # the other session was not touched: its continuation is exact
    def append(start, tokens):
        return route.append("keep", 1, 6, other_prompt[6:]) if start == 0 else route.append("keep", 1, start, tokens)

    tokens, logits = greedy_with_logits(append, other_prompt, GREEDY)
    assert tokens == expected_tokens
    assert np.abs(logits - expected_logits).max() == 0.0
    release_all(chain_daemons)


def test_unknown_session_is_a_cache_miss_and_position_zero_admits(chain_daemons, prompt_ids):
    with chain_daemons[0].client() as client:
        with pytest.raises(KvpoolError) as miss:
            client.append("never-seen", 1, 3, tokens=[1, 2])
        assert miss.value.code == "cache_miss" and miss.value.reason == "unknown"
        assert client.stats().sessions == []
        result = client.append("never-seen", 1, 0, tokens=prompt_ids[0][:4])
        assert result.admitted and result.length == 4
        assert not client.append("never-seen", 1, 4, tokens=prompt_ids[0][4:6]).admitted
    release_all(chain_daemons)


def test_stale_epoch_is_rejected_untouched_and_newer_epoch_releases_old_state(route, local_chain, chain_daemons, prompt_ids):
    prompt = prompt_ids[0]
    sid = f"epoch-{route.name}"
    route.append(sid, 5, 0, prompt[:6])
    reserved = [_reserved(daemon) for daemon in chain_daemons]
    for call in (
        lambda c: c.append(sid, 4, 6, tokens=[1]) if c.shard.shape.is_first else c.append(sid, 4, 6, hidden=np.zeros((1, 576), np.float32)),
        lambda c: c.truncate(sid, 4, 0),
        lambda c: c.release(sid, 4),
        lambda c: c.cancel(sid, 4),
    ):
        for client in route.clients:
            with pytest.raises(KvpoolError) as stale:
                call(client)
            assert stale.value.code == "stale_epoch"
    assert [_reserved(daemon) for daemon in chain_daemons] == reserved
    # untouched: epoch 5 continues exactly
    logits = route.append(sid, 5, 6, prompt[6:])
    with local_chain.new_session(N_CTX) as fresh:
        assert np.abs(logits - fresh.append(0, prompt)).max() == 0.0
    # a newer epoch releases the old state first; without state, position > 0 is a miss (new_epoch)
    with pytest.raises(KvpoolError) as newer:
        route.append(sid, 6, len(prompt), [7])
    assert newer.value.code == "cache_miss" and newer.value.reason == "new_epoch"
    assert _reserved(chain_daemons[0]) == 0
    logits = route.append(sid, 6, 0, prompt)
    with local_chain.new_session(N_CTX) as fresh:
        assert np.abs(logits - fresh.append(0, prompt)).max() == 0.0
    with pytest.raises(KvpoolError) as old:
        route.append(sid, 5, len(prompt), [7])
    assert old.value.code == "stale_epoch"
    release_all(chain_daemons)


def test_context_full_is_an_error_not_a_crash(chain_daemons, prompt_ids):
    with chain_daemons[0].client() as client:
        client.append("small", 1, 0, tokens=prompt_ids[1][:10], n_ctx=16)
        with pytest.raises(KvpoolError) as full:
            client.append("small", 1, 10, tokens=prompt_ids[1][10:17])
        assert full.value.code == "context_full" and full.value.length == 10
        assert client.append("small", 1, 10, tokens=prompt_ids[1][10:16]).length == 16
        with pytest.raises(KvpoolError) as too_big:
            client.append("big", 1, 0, tokens=[1], n_ctx=N_CTX + 1)
        assert too_big.value.code == "bad_request"
    release_all(chain_daemons)


def test_four_concurrent_sessions_through_the_chain_equal_each_alone(chain_daemons, local_chain, tokenizer, prompt_ids):
    prompts = [
        prompt_ids[0],
        prompt_ids[1],
        tokenizer.encode(tokenizer.chat_prompt("List four fruits.")),
        tokenizer.encode(tokenizer.chat_prompt("Why is the sky blue? Answer briefly.")),
    ]
    expected = [_alone(local_chain, prompt, chunk=5 + index) for index, prompt in enumerate(prompts)]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        clients = [daemon.client() for daemon in chain_daemons]
        try:
            results[index] = _through(clients, f"concurrent-{index}", 3, prompts[index], chunk=5 + index)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)
        finally:
            for client in clients:
                client.close()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), f"hang guard: a session was still running after {HANG_GUARD_S:.0f} s"
    assert not errors, errors
    for index in range(4):
        tokens, logits = results[index]
        assert tokens == expected[index][0], f"session {index} diverged"
        assert np.abs(logits - expected[index][1]).max() == 0.0
    for daemon in chain_daemons:
        with daemon.client() as client:
            stats = client.stats()
            assert len(stats.sessions) == 4 and stats.integrity == "ok"
            assert 1 <= stats.counters["peak_concurrent_compute_threads"] <= 1  # --threads 1
    release_all(chain_daemons)


def test_cancel_aborts_an_inflight_prefill_and_rolls_back(model_path, socket_dir, tokenizer):
    daemon = DaemonProcess(model_path, socket_dir / "cancel.sock", "--threads", "1", "--n-ctx", "2048", "--max-sessions", "2")
    try:
        text = " ".join(f"word{i}" for i in range(900))
        long_prompt = tokenizer.encode(text)[:1900]
        # through the supervisor (tests/daemon/test_direct_channel.py cancels an append on the direct channel)
        with daemon.client(direct=False) as client, daemon.client() as reference:
            client.append("cancel", 1, 0, tokens=long_prompt[:10])
            worker_pid = reference.stats().sessions[0].worker_pid
            # The worker is stopped before the long append is sent: it cannot finish before the cancel lands,
            # however fast the machine; the cancel is accepted once the append is on its way to the worker.
            with _stopped(worker_pid):
                thread, outcome = _in_thread(lambda: client.append("cancel", 1, 10, tokens=long_prompt[10:]))
                _wait_until(lambda: reference.stats().sessions[0].in_flight, "the long append to be in flight")
                done = _wait_until(
                    lambda: (reply := client.cancel("cancel", 1)).detail != "nothing in flight" and reply,
                    "the long append to reach its worker",
                )
                assert done.detail == "cancel requested"
            _joined(thread, outcome)
            error = outcome.get("error")
            assert isinstance(error, KvpoolError) and error.code == "cancelled", outcome
            assert error.length == 10
            assert reference.stats().sessions[0].length == 10
            # continuing after the rollback equals a run that was never cancelled
            logits = client.append("cancel", 1, 10, tokens=long_prompt[10:40]).rows
            fresh = reference.append("fresh", 1, 0, tokens=long_prompt[:40]).rows
            assert np.abs(logits - fresh).max() == 0.0
            assert reference.stats().counters["cancels"] == 1
            nothing = client.cancel("cancel", 1)
            assert nothing.detail == "nothing in flight"
    finally:
        daemon.stop()


# ---- budget, eviction, expiry ---------------------------------------------------------------------


def test_lru_eviction_on_admission_spares_recent_and_returns_bytes(shards, socket_dir, local_chain, prompt_ids):
    first = shards[0]
    daemon = DaemonProcess(first.path, socket_dir / "lru.sock", "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "2", "--spill-budget", "0")
    try:
        with daemon.client() as client:
            a = client.append("lru-a", 1, 0, tokens=prompt_ids[0][:8]).rows
            client.append("lru-b", 1, 0, tokens=prompt_ids[1][:8])
            time.sleep(0.01)
            client.append("lru-a", 1, 8, tokens=prompt_ids[0][8:10])  # a is now the most recently used
            reserved_two = client.stats().budget.reserved_bytes
            client.append("lru-c", 1, 0, tokens=prompt_ids[1][:5])  # needs a worker: evicts b
            stats = client.stats()
            assert {row.session_id for row in stats.sessions} == {"lru-a", "lru-c"}
            assert stats.budget.reserved_bytes == reserved_two and stats.counters["evictions"] == 1
            with pytest.raises(KvpoolError) as miss:
                client.append("lru-b", 1, 8, tokens=[1])
            assert miss.value.code == "cache_miss" and miss.value.reason == "evicted"
            # a was not touched
            continued = client.append("lru-a", 1, 10, tokens=prompt_ids[0][10:14]).rows
        with local_chain.models[0].new_context(N_CTX) as fresh:
            expected_a = fresh.append(0, tokens=np.asarray(prompt_ids[0][:8]))
            fresh.append(8, tokens=np.asarray(prompt_ids[0][8:10]))
            expected_continued = fresh.append(10, tokens=np.asarray(prompt_ids[0][10:14]))
        assert np.array_equal(a, expected_a) and np.array_equal(continued, expected_continued)
    finally:
        daemon.stop()


def test_no_admission_measures_and_the_first_shard_costs_no_more_than_the_others(chain_daemons, shards, socket_dir):
    """Charges are fitted from the start-up probe: an admission of an n_ctx no daemon has
    measured runs no calibration, and is charged at least its theoretical KV and what a daemon measures for
    that n_ctx later. The first shard is charged like the others (its lookahead layer keeps llama.cpp's
    output buffer at one row of logits instead of 512)."""
    unseen = 300
    charges, measured = [], []
    for daemon, shard in zip(chain_daemons, shards):
        with daemon.client() as client:
            stats = client.stats()
            assert [row.n_ctx for row in stats.calibration] == [N_CTX]  # the probe's one 512-row batch fills it
            assert stats.counters["calibrations"] == 1
            rows = {"tokens": [1, 2, 3]} if shard.shape.is_first else {"hidden": np.zeros((3, shard.shape.n_embd), np.float32)}
            client.append("unseen", 1, 0, n_ctx=unseen, **rows)
            after = client.stats()
            [session] = after.sessions
            assert session.n_ctx == unseen and after.counters["calibrations"] == 1  # nothing measured
            per_position = stats.calibration[-1].theoretical_kv_bytes // N_CTX
            assert session.charged_bytes >= unseen * per_position > 0
            charges.append(session.charged_bytes)
            measured.append(stats.calibration[-1].measured_bytes)
            client.release("unseen", 1)
    first, middle, last = measured  # a context of N_CTX after one 512-row batch, each shard 10 layers
    assert first <= 1.5 * middle and last <= 1.5 * middle, [m / 2**20 for m in measured]
    for index, (shard, charge) in enumerate(zip(shards, charges)):
        daemon = DaemonProcess(shard.path, socket_dir / f"measure{index}.sock", "--threads", "1", "--n-ctx", str(unseen), "--max-sessions", "1",
                               "--calibration-cache", "off")
        try:
            with daemon.client() as client:
                [later] = [row for row in client.stats().calibration if row.n_ctx == unseen]
        finally:
            daemon.stop()
        assert charge >= later.measured_bytes, (shard.path.name, charge, later.measured_bytes)


def test_budget_admission_over_budget_and_waiting(shards, socket_dir, prompt_ids):
    first = shards[0]
    # n_ctx 64 sessions; the budget fits exactly one of them (charge measured at start, reported in stats)
    probe = DaemonProcess(first.path, socket_dir / "probe.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "1")
    try:
        with probe.client() as client:
            client.append("probe", 1, 0, tokens=[1, 2])
            charge = client.stats().sessions[0].charged_bytes
    finally:
        probe.stop()
    daemon = DaemonProcess(first.path, socket_dir / "budget.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "3", "--budget", str(charge + charge // 2), "--spill-budget", "0")
    try:
        with daemon.client() as client, daemon.client(direct=False) as other:  # in flight as soon as the daemon reads it
            client.append("busy", 1, 0, tokens=prompt_ids[0][:4])
            # an idle session is evicted to make room
            client.append("second", 1, 0, tokens=prompt_ids[0][:4])
            stats = client.stats()
            assert [row.session_id for row in stats.sessions] == ["second"] and stats.counters["evictions"] == 1
            second_pid = stats.sessions[0].worker_pid
            # a session with a request in flight is never evicted: its worker is stopped, so the append
            # stays in flight until the block ends
            long_tokens = (prompt_ids[1] * 4)[:40]
            with _stopped(second_pid):
                holder, held = _in_thread(lambda: other.append("second", 1, 4, tokens=long_tokens))
                _wait_until(lambda: client.stats().sessions[0].in_flight, "the holder's append to be in flight")
                with pytest.raises(KvpoolError) as over:
                    client.append("third", 1, 0, tokens=[1, 2])
                assert over.value.code == "over_budget"
            assert _result(holder, held).length == 4 + len(long_tokens)
            assert [row.session_id for row in client.stats().sessions] == ["second"]
            # waiting admission: bytes released while "third" waits are taken, with no eviction. "second" is
            # kept busy (stopped worker) until both the waiting admission and the release have been read by
            # the daemon; the release then waits for that append, and counts as in flight meanwhile, so
            # "second" is never idle, never evictable: only the release can make room.
            length = 4 + len(long_tokens)
            with _stopped(second_pid):
                holder, held = _in_thread(lambda: other.append("second", 1, length, tokens=[5]))
                _wait_until(lambda: client.stats().sessions[0].in_flight, "the holder's append to be in flight")
                waiter = sent_and_read(daemon.socket, Append(session_id="third", epoch=1, start_pos=0, tokens=[1, 2], admit_timeout_s=MAX_ADMIT_WAIT_S))
                releaser = sent_and_read(daemon.socket, Release(session_id="second", epoch=1))
                assert [row.session_id for row in client.stats().sessions] == ["second"]  # nothing admitted yet
            assert _result(holder, held).length == length + 1
            released = read_reply(releaser)
            assert isinstance(released, Done) and released.detail == "released", released
            result = read_reply(waiter)
            waiter.close()
            releaser.close()
            assert isinstance(result, AppendReply) and result.admitted and result.length == 2, result  # woken by the release
            stats = client.stats()
            assert [row.session_id for row in stats.sessions] == ["third"] and stats.counters["evictions"] == 1
            assert stats.budget.reserved_bytes <= stats.budget.limit_bytes and stats.integrity == "ok"
            with pytest.raises(KvpoolError) as gone:
                other.append("second", 1, length + 1, tokens=[1])
            assert gone.value.code == "cache_miss" and gone.value.reason == "released"
    finally:
        daemon.stop()


def test_over_budget_while_the_only_session_is_busy_then_waiting_admission_wakes(shards, socket_dir, prompt_ids):
    first = shards[0]
    daemon = DaemonProcess(first.path, socket_dir / "wait.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "1", "--spill-budget", "0")
    try:
        holder_tokens = prompt_ids[1]
        # the holder's append through the supervisor: a direct append counts as in flight only once its
        # worker reads it, and this worker is stopped before it could
        with daemon.client() as client, daemon.client(direct=False) as other:
            other.append("holder", 1, 0, tokens=holder_tokens[:4])
            holder_pid = client.stats().sessions[0].worker_pid
            # the holder's append stays in flight until the block ends (its worker is stopped), on any machine
            with _stopped(holder_pid):
                holder, held = _in_thread(lambda: other.append("holder", 1, 4, tokens=holder_tokens[4:]))
                _wait_until(lambda: client.stats().sessions[0].in_flight, "the holder's append to be in flight")
                # the only session has a request in flight: it is never evicted, so there is no room
                with pytest.raises(KvpoolError) as over:
                    client.append("waiter", 1, 0, tokens=[1, 2])
                assert over.value.code == "over_budget"
                assert over.value.reply.retry_after_s > 0  # the daemon's estimate of when to ask again
                # an admission that may wait, read by the daemon while the holder is still busy: it waits
                waiter = sent_and_read(daemon.socket, Append(session_id="waiter", epoch=1, start_pos=0, tokens=[1, 2], admit_timeout_s=MAX_ADMIT_WAIT_S))
                assert [row.session_id for row in client.stats().sessions] == ["holder"]  # nothing admitted yet
            result = read_reply(waiter)  # the holder's worker continues, the holder goes idle, the waiter wakes
            waiter.close()
            assert _result(holder, held).length == len(holder_tokens)  # the busy session finished untouched
            assert isinstance(result, AppendReply) and result.admitted and result.length == 2, result  # woken when the holder went idle
            stats = client.stats()
            assert [row.session_id for row in stats.sessions] == ["waiter"] and stats.counters["evictions"] == 1
            with pytest.raises(KvpoolError) as evicted:
                other.append("holder", 1, len(holder_tokens), tokens=[5])
            assert evicted.value.code == "cache_miss" and evicted.value.reason == "evicted"
    finally:
        daemon.stop()


def test_ttl_expires_idle_sessions(shards, socket_dir, prompt_ids):
    daemon = DaemonProcess(shards[0].path, socket_dir / "ttl.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "1", "--ttl", "1")
    try:
        with daemon.client() as client, daemon.client() as observer:
            (worker,) = observer.stats().workers
            # while its admission is in flight (the only worker stopped) the session is busy, never expired:
            # its bytes are reserved however slowly this machine runs
            with _stopped(worker.pid):
                admission, admitted = _in_thread(lambda: client.append("short-lived", 1, 0, tokens=prompt_ids[0][:4]))
                stats = _wait_until(lambda: (s := observer.stats()).sessions and s, "the admission to be in flight")
                assert stats.sessions[0].in_flight and stats.budget.reserved_bytes == stats.sessions[0].charged_bytes > 0
            result = _result(admission, admitted)
            assert result.admitted and result.length == 4
            # idle now: expired after its TTL by the daemon's housekeeping (polled; the deadline is a hang guard)
            def expired():
                stats = observer.stats()
                return stats if stats.counters["expirations"] and not stats.sessions else None

            stats = _wait_until(expired, "the idle session to expire")
            assert stats.sessions == [] and stats.budget.reserved_bytes == 0 and stats.counters["expirations"] == 1
            with pytest.raises(KvpoolError) as miss:
                client.append("short-lived", 1, 4, tokens=[1])
            assert miss.value.code == "cache_miss" and miss.value.reason == "expired"
    finally:
        daemon.stop()


# ---- crash containment ----------------------------------------------------------------------------


def test_killed_worker_loses_one_session_only_and_is_replaced(route, chain_daemons, local_chain, prompt_ids):
    victim, survivor = f"victim-{route.name}", f"survivor-{route.name}"  # the daemons remember epochs
    victim_prompt, survivor_prompt = prompt_ids[1], prompt_ids[0]
    expected_tokens, expected_logits = _alone(local_chain, survivor_prompt)
    route.append(victim, 1, 0, victim_prompt)
    route.append(survivor, 1, 0, survivor_prompt[:5])
    middle = chain_daemons[1]
    with middle.client() as client:
        stats = client.stats()
        victim_pid = next(row.worker_pid for row in stats.sessions if row.session_id == victim)
        workers_before = len(stats.workers)
    os.kill(victim_pid, signal.SIGKILL)
    with pytest.raises(KvpoolError) as lost:
        route.append(victim, 1, len(victim_prompt), [42])
    assert lost.value.code in ("worker_lost", "cache_miss")
    # the middle shard reports why it has no state (the first shard has taken the token: the router's
    # business, it replays the route from 0)
    with pytest.raises(KvpoolError) as after:
        route.clients[1].append(victim, 1, len(victim_prompt) + 1, hidden=np.zeros((1, 576), np.float32))
    assert after.value.code == "cache_miss" and after.value.reason == "worker_lost"

    def append(start, tokens):
        return route.append(survivor, 1, 5, survivor_prompt[5:]) if start == 0 else route.append(survivor, 1, start, tokens)

    tokens, logits = greedy_with_logits(append, survivor_prompt, GREEDY)
    assert tokens == expected_tokens
    assert np.abs(logits - expected_logits).max() == 0.0
    with middle.client() as client:

        def replaced():
            stats = client.stats()
            return stats if len(stats.workers) == workers_before and victim_pid not in {w.pid for w in stats.workers} else None

        stats = _wait_until(replaced, "the killed worker to be replaced")
        assert len(stats.workers) == workers_before and stats.counters["worker_restarts"] >= 1
        assert victim_pid not in {w.pid for w in stats.workers}
    # the victim replays from 0 and gets the exact result
    route.release(victim, 1)
    logits = route.append(victim, 2, 0, victim_prompt)
    with local_chain.new_session(N_CTX) as fresh:
        assert np.abs(logits - fresh.append(0, victim_prompt)).max() == 0.0
    release_all(chain_daemons)


def test_drifted_worker_is_recycled_when_idle(shards, socket_dir):
    daemon = DaemonProcess(shards[0].path, socket_dir / "drift.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "1", "--memory-margin", "1")
    try:
        with daemon.client() as client:
            pid_before = client.stats().workers[0].pid
            client.append("drift", 1, 0, tokens=list(range(1, 60)))
            client.release("drift", 1)  # freed context, but USS stays above the 1-byte margin

            def recycled():
                stats = client.stats()
                return stats if stats.workers and stats.workers[0].pid != pid_before else None

            stats = _wait_until(recycled, "the drifted worker to be recycled")
            assert stats.workers[0].pid != pid_before and stats.counters["worker_restarts"] >= 1
            assert client.append("after", 1, 0, tokens=[1, 2]).length == 2
    finally:
        daemon.stop()


# ---- safety and operations ------------------------------------------------------------------------


def test_socket_is_private_and_bad_frames_never_hurt_the_daemon(chain_daemons, prompt_ids):
    first = chain_daemons[0]
    mode = os.stat(first.socket).st_mode
    assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(os.stat(first.socket.parent).st_mode) == 0o700
    with first.client() as live:
        live.append("live", 1, 0, tokens=prompt_ids[0][:6])
        # no Hello first
        sock = raw_connection(first.socket)
        sock.sendall(encode(Stats()))
        reply = read_reply(sock)
        assert reply.code == "bad_request" and read_reply(sock) is None
        sock.close()
        # wrong protocol version
        sock = raw_connection(first.socket)
        sock.sendall(encode(Hello(version=PROTOCOL_VERSION + 1)))
        assert read_reply(sock).code == "bad_request" and read_reply(sock) is None
        sock.close()
        # garbage, unknown tag, wrong types, then an absurd length
        sock = raw_connection(first.socket)
        sock.sendall(encode(Hello(version=PROTOCOL_VERSION)))
        assert read_reply(sock).version == PROTOCOL_VERSION
        for payload in (b"\xc1\xc1\xc1", b"\x81\xa4type\xa4Nope", b"\x82\xa4type\xa6Append\xaasession_id\x05"):
            sock.sendall(FRAME_HEADER.pack(len(payload)) + payload)
            assert read_reply(sock).code == "bad_request"
        for bad in (
            Append(session_id="live", epoch=1, start_pos=6, tokens=[-1]),
            Append(session_id="live", epoch=1, start_pos=6, tokens=[49152]),
            Append(session_id="live", epoch=1, start_pos=6, hidden=b"\0" * 16),
            Append(session_id="live", epoch=1, start_pos=6, tokens=[]),
            Append(session_id="", epoch=1, start_pos=0, tokens=[1]),
            Append(session_id="live", epoch=-1, start_pos=6, tokens=[1]),
            Append(session_id="live", epoch=1, start_pos=-6, tokens=[1]),
        ):
            sock.sendall(encode(bad))
            reply = read_reply(sock)
            assert reply.code == "bad_request", bad
        sock.sendall(FRAME_HEADER.pack(2**31))
        assert read_reply(sock).code == "bad_request" and read_reply(sock) is None
        sock.close()
        # the live session was not touched by any of it
        stats = live.stats()
        assert [(row.session_id, row.length) for row in stats.sessions] == [("live", 6)]
        assert live.append("live", 1, 6, tokens=prompt_ids[0][6:8]).length == 8
    release_all(chain_daemons)


def test_other_users_are_refused_by_peer_credentials(chain_daemons):
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another uid")  # CI runs as root
    first = chain_daemons[0]
    os.chmod(first.socket.parent, 0o711)
    os.chmod(first.socket, 0o666)
    try:
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - child process
            os.close(read_end)
            result = b"?"
            try:
                os.setgid(65534)
                os.setuid(65534)
                sock = raw_connection(first.socket)
                sock.sendall(encode(Hello(version=PROTOCOL_VERSION)))
                result = b"closed" if read_reply(sock) is None else b"answered"
            except (BrokenPipeError, ConnectionResetError):
                result = b"closed"  # the daemon hung up before or while we wrote
            except Exception as error:  # noqa: BLE001
                result = repr(error).encode()
            os.write(write_end, result)
            os._exit(0)
        os.close(write_end)
        os.waitpid(child, 0)
        answer = os.read(read_end, 200)
        os.close(read_end)
        assert answer == b"closed"
    finally:
        os.chmod(first.socket.parent, 0o700)
        os.chmod(first.socket, 0o600)


def test_status_command_and_prometheus_metrics(shards, socket_dir, prompt_ids):
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = DaemonProcess(shards[0].path, socket_dir / "status.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "2", "--metrics-port", str(port))
    try:
        with daemon.client() as client:
            client.append("shown", 7, 0, tokens=prompt_ids[0][:9])
            with pytest.raises(KvpoolError):
                client.append("missing", 1, 2, tokens=[1])
        status = subprocess.run(
            [sys.executable, "-m", "kvpool", "status", "--socket", str(daemon.socket)], capture_output=True, text=True, timeout=HANG_GUARD_S
        )
        assert status.returncode == 0, status.stderr
        line = next(line for line in status.stdout.splitlines() if line.startswith("shown"))
        assert line.split()[:4] == ["shown", "7", "9", "64"]
        assert "books: ok" in status.stdout and "reserved" in status.stdout
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HANG_GUARD_S).read().decode()
        assert "kvpool_appends_total 1.0" in metrics
        assert 'kvpool_cache_misses_by_reason_total{reason="unknown"} 1.0' in metrics
        assert "kvpool_sessions 1.0" in metrics
    finally:
        daemon.stop()


def test_sigint_and_shutdown_request_stop_cleanly(shards, socket_dir):
    daemon = DaemonProcess(shards[0].path, socket_dir / "sigint.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "2")
    with daemon.client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3])
    assert daemon.stop(sig=signal.SIGINT) == 0
    daemon = DaemonProcess(shards[0].path, socket_dir / "shutdown.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "2")
    children = [psutil.Process(pid) for pid in daemon.worker_pids()]  # workers and multiprocessing's tracker
    assert len(children) >= 2
    with daemon.client() as client:
        client.shutdown()
    assert daemon.process.wait(STOP_HANG_GUARD_S) == 0
    assert daemon.stop() == 0
    alive = exited_all(children, "the daemon's workers and resource tracker")
    assert not alive, f"left behind: {alive}"

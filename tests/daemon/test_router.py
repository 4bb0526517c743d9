"""kvpool.router.router on real daemons: every recovery of the policy, each followed by a continuation that is bit
for bit what an uninterrupted run gives (same append partition, in process: kvpool.local.chain.LocalChain).
Waits are hang guards only; a stopped worker keeps a request in flight on any machine."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest

from kvpool.client.client import Client
from kvpool.router.router import Cancelled, RecoveryPolicy, Router
from kvpool.shard.errors import ShardError
from kvpool.shard.route import check_route
from kvpool.wire.protocol import ShardDescription
from tests.support.chains import daemon_chain, greedy_with_logits, release_all
from tests.support.daemons import DaemonProcess, exited, in_thread, joined, result, stopped, wait_until

pytestmark = pytest.mark.timeout(3600)
N_CTX = 512
GREEDY = 12
CHUNK = 7
OPTIONS = ("--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "2")
QUICK = RecoveryPolicy(backoff_base_s=0.01, backoff_max_s=0.1)


@pytest.fixture(scope="module")
def daemons(shards, socket_dir):
    with daemon_chain([shard.path for shard in shards], socket_dir, "route", *OPTIONS) as started:
        yield started


@pytest.fixture
def clients(daemons):
    clients = [daemon.client() for daemon in daemons]
    yield clients
    for client in clients:
        client.close()
    release_all(daemons)


def _greedy(append, prompt, before_step=None):
    """Greedy tokens and the logits each was chosen from; before_step(n) runs before the n-th append."""
    return greedy_with_logits(append, prompt, GREEDY, prefill_chunk=CHUNK, before_step=before_step)


def _alone(local_chain, prompt):
    with local_chain.new_session(N_CTX) as session:
        return _greedy(session.append, prompt)


def _assert_exact(got, expected):
    assert got[0] == expected[0]
    assert np.abs(got[1] - expected[1]).max() == 0.0


def _held(client: Client, session_id: str) -> tuple[int, int] | None:
    row = next((row for row in client.stats().sessions if row.session_id == session_id), None)
    return None if row is None else (row.epoch, row.length)


# ---- replay -------------------------------------------------------------------------------------------


def test_a_cache_miss_mid_route_is_replayed_under_a_new_epoch_and_the_continuation_is_exact(clients, local_chain, prompt_ids):
    prompt = prompt_ids[1]
    router = Router(clients)
    session = router.session("miss")
    steps = len(range(0, len(prompt), CHUNK))

    def behind_the_routers_back(step):
        if step == steps + 4:  # after the prefill and four decodes: the middle daemon forgets the session
            clients[1].release("miss", session.epoch)

    got = _greedy(session.append_at, prompt, behind_the_routers_back)
    _assert_exact(got, _alone(local_chain, prompt))
    counts = session.counts
    assert (counts.cache_misses, counts.replays, counts.workers_lost, counts.connections_lost) == (1, 1, 0, 0)
    assert counts.replayed_tokens == len(prompt) + 4 and router.counts == counts
    assert session.epoch == 2 and session.length == len(prompt) + GREEDY
    assert [_held(client, "miss") for client in clients] == [(2, session.length)] * 3  # epoch 1 released


def test_a_daemon_holding_fewer_tokens_is_caught_up_by_a_tail_replay_and_the_continuation_is_exact(clients, local_chain, prompt_ids):
    """What a crash leaves when states were written behind (--persist-after) and adopted: daemons holding
    the session at shorter lengths, each where an append ended. Made here behind the router's back by
    truncating two daemons to different lengths: the next append meets position_mismatch; the router
    truncates every daemon to the shortest length one holds and replays only the tokens after it, under
    the same epoch: no full replay, and the continuation is bit for bit an uninterrupted run's."""
    prompt = prompt_ids[1]
    router = Router(clients)
    session = router.session("tail")
    steps = len(range(0, len(prompt), CHUNK))

    def behind_the_routers_back(step):
        if step == steps + 4:  # after the prefill and four decodes
            clients[1].truncate("tail", session.epoch, len(prompt) + 2)
            clients[2].truncate("tail", session.epoch, len(prompt))

    got = _greedy(session.append_at, prompt, behind_the_routers_back)
    _assert_exact(got, _alone(local_chain, prompt))
    counts = session.counts
    assert (counts.position_mismatches, counts.tail_replays, counts.tail_replayed_tokens) == (1, 1, 4)
    assert (counts.replays, counts.replayed_tokens, counts.cache_misses) == (0, 0, 0) and router.counts == counts
    assert session.epoch == 1 and [_held(client, "tail") for client in clients] == [(1, session.length)] * 3


def test_a_daemon_holding_a_length_inside_an_append_is_replayed_in_full(clients, local_chain, prompt_ids):
    """An exact tail replay must start where an append ended (the same partition): a length inside the first
    prefill chunk starts a full replay under a new epoch instead."""
    prompt = prompt_ids[1]
    router = Router(clients)
    session = router.session("inside")
    steps = len(range(0, len(prompt), CHUNK))

    def behind_the_routers_back(step):
        if step == steps + 2:
            clients[2].truncate("inside", session.epoch, CHUNK - 3)

    got = _greedy(session.append_at, prompt, behind_the_routers_back)
    _assert_exact(got, _alone(local_chain, prompt))
    counts = session.counts
    assert (counts.position_mismatches, counts.tail_replays, counts.replays) == (1, 0, 1)
    assert counts.replayed_tokens == len(prompt) + 2 and session.epoch == 2


def test_a_killed_worker_is_replayed_and_the_continuation_is_exact(clients, local_chain, prompt_ids):
    prompt = prompt_ids[0]
    session = Router(clients).session("killed")

    def kill_the_last_daemons_worker(step):
        if step == 5:
            pid = next(row.worker_pid for row in clients[2].stats().sessions if row.session_id == "killed")
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: exited(pid), "the worker to die")

    got = _greedy(session.append_at, prompt, kill_the_last_daemons_worker)
    _assert_exact(got, _alone(local_chain, prompt))
    assert session.counts.cache_misses + session.counts.workers_lost == 1 and session.counts.replays == 1
    assert [_held(client, "killed") for client in clients] == [(2, session.length)] * 3


def test_a_restarted_daemon_is_reconnected_to_and_the_session_replayed_exactly(daemons, shards, socket_dir, local_chain, prompt_ids):
    prompt = prompt_ids[0]
    last = DaemonProcess(shards[2].path, socket_dir / "restarted.sock", *OPTIONS)
    clients = [daemons[0].client(), daemons[1].client(), last.client()]
    session = Router(clients).session("restarted")
    holder = [last]

    def restart_the_last_daemon(step):
        if step == 5:
            holder[0].process.kill()  # its workers follow it (lifeline); its socket file stays
            holder[0].process.wait()
            holder[0].socket.unlink()
            holder[0].stop()
            holder[0] = DaemonProcess(shards[2].path, socket_dir / "restarted.sock", *OPTIONS)

    try:
        got = _greedy(session.append_at, prompt, restart_the_last_daemon)
        _assert_exact(got, _alone(local_chain, prompt))
        assert session.counts.connections_lost == 1 and session.counts.replays == 1
        assert [_held(client, "restarted") for client in clients] == [(2, session.length)] * 3
        session.release()
    finally:
        for client in clients:
            client.close()
        holder[0].stop()


# ---- back-off, cancel ---------------------------------------------------------------------------------


def test_over_budget_is_retried_with_back_off_until_room_frees_up(daemons, shards, socket_dir, local_chain, prompt_ids):
    """The middle daemon has room for one session, busy (its worker stopped) until the router has been
    refused at least once; then it goes idle, and the router's next try evicts it."""
    middle = DaemonProcess(shards[1].path, socket_dir / "one.sock", "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1", "--spill-budget", "0")
    clients = [daemons[0].client(), middle.client(), daemons[2].client()]
    try:
        router = Router(clients, policy=QUICK)
        holder = router.session("holder")
        holder.append(prompt_ids[0])
        holder_pid = clients[1].stats().sessions[0].worker_pid
        waiter = router.session("waiter")
        with middle.client() as other:  # a Client carries one request at a time: the holder's own
            with stopped(holder_pid):
                busy = in_thread(lambda: other.append("holder", holder.epoch, holder.length, hidden=np.zeros((3, 576), np.float32)))
                wait_until(lambda: clients[1].stats().sessions[0].in_flight, "the holder's append to be in flight")
                waiting = in_thread(lambda: waiter.append(prompt_ids[1]))
                wait_until(lambda: waiter.counts.over_budget_retries >= 1, "the router to be refused and back off")
                assert waiting[0].is_alive()
            assert result(*busy).length == holder.length + 3
        logits = result(*waiting)
        with local_chain.new_session(N_CTX) as alone:
            assert np.abs(logits - alone.append(0, prompt_ids[1])).max() == 0.0
        assert waiter.counts.replays == 0 and waiter.counts.over_budget_retries >= 1
        assert [row.session_id for row in clients[1].stats().sessions] == ["waiter"]  # the idle holder was evicted
        waiter.release()
        holder.release()
    finally:
        for client in clients:
            client.close()
        middle.stop()


def test_a_cancel_rolls_back_the_daemons_before_and_the_session_continues_exactly(daemons, clients, local_chain, prompt_ids):
    prompt, filler = prompt_ids[0], (prompt_ids[1] * 10)[:300]
    session = Router(clients).session("cancel")
    logits = session.append(prompt)
    middle_pid = next(row.worker_pid for row in clients[1].stats().sessions)
    with stopped(middle_pid), daemons[1].client() as observer:  # the router's client is busy with the append
        thread, outcome = in_thread(lambda: session.append(filler))
        wait_until(lambda: observer.stats().sessions[0].in_flight or clients[1].direct_in_flight("cancel", 1),
                   "the long append to be in flight on the middle daemon")
        assert session.cancel()
    error = joined(thread, outcome).get("error")
    assert isinstance(error, Cancelled) and error.stage in (1, 2), outcome  # the daemon aborted it, or the router stopped it
    assert [_held(client, "cancel") for client in clients] == [(1, len(prompt))] * 3
    assert session.counts.rollbacks == 1 and session.counts.replays == 0 and session.tokens == tuple(prompt)
    assert not session.cancel()  # nothing in flight
    rows = [logits[-1].copy()]
    for _ in range(3):
        rows.append(session.append([int(np.argmax(rows[-1]))])[-1].copy())
    with local_chain.new_session(N_CTX) as alone:
        expected = [alone.append(0, prompt)[-1].copy()]
        for position in range(len(prompt), len(prompt) + 3):
            expected.append(alone.append(position, [int(np.argmax(expected[-1]))])[-1].copy())
    assert np.abs(np.stack(rows) - np.stack(expected)).max() == 0.0


def test_truncate_then_continue_through_the_router_equals_a_fresh_run(clients, local_chain, prompt_ids):
    prompt = prompt_ids[1]
    session = Router(clients).session("trunc")
    session.append(prompt)
    session.append([11, 12, 13])
    session.truncate(len(prompt) - 4)
    clients[0].release("trunc", session.epoch)  # and a miss after the truncate: the replay repeats the cut history
    logits = session.append(prompt_ids[0][:6])
    with local_chain.new_session(N_CTX) as fresh:
        fresh.append(0, prompt[: len(prompt) - 4])
        expected = fresh.append(len(prompt) - 4, prompt_ids[0][:6])
    assert np.abs(logits - expected).max() == 0.0
    assert session.counts.replays == 1 and session.tokens == tuple(prompt[: len(prompt) - 4]) + tuple(prompt_ids[0][:6])


# ---- without daemons ----------------------------------------------------------------------------------


def test_back_off_doubles_with_jitter_is_bounded_and_the_daemons_hint_wins():
    policy = RecoveryPolicy(backoff_base_s=0.1, backoff_max_s=1.0)
    rng = random.Random(1)
    for attempt, ceiling in enumerate((0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0)):
        delays = [policy.delay_s(attempt, rng) for _ in range(50)]
        assert all(ceiling / 2 <= delay <= ceiling for delay in delays) and len(set(delays)) > 1
    assert policy.delay_s(0, rng, retry_after_s=0.7) == 0.7 and policy.delay_s(5, rng, retry_after_s=9.0) == 9.0
    with pytest.raises(ValueError):
        RecoveryPolicy(backoff_base_s=2.0, backoff_max_s=1.0)


def test_one_route_check_for_shard_files_and_for_what_daemons_serve(shards):
    check_route(shards)
    served = [
        ShardDescription(shape=s.shape, model_path=str(s.path), source_sha256=s.source_sha256 or "")
        for s in shards
    ]
    check_route(served)
    for broken in (served[:2], [served[0], served[2]], served[1:], [served[1], served[0], served[2]]):
        with pytest.raises(ShardError):
            check_route(broken)
    other_model = [served[0], ShardDescription(**{**{f: getattr(served[1], f) for f in served[1].__struct_fields__}, "source_sha256": "0" * 64}), served[2]]
    with pytest.raises(ShardError, match="different model"):
        check_route(other_model)

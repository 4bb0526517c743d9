"""Epoch fencing under races and at volume (issue 17, items 1 and 2) on fake workers, the supervisor's path
(the direct channel's variants stay in tests/daemon/test_fencing.py).

The rule: once epoch e is seen for a session id, nothing of an epoch below e is created, served or exposed,
on any path (supervisor, fork, restore). A request that waited (for admission, for a lock, for a compute
slot) checks again after the wait. And the fence does not forget with traffic: a daemon remembers a bounded
number of ids and, past it, raises an epoch floor below which an id it does not know is stale. A stopped
fake worker (FakeDaemon.stopped) keeps a request in flight, as a SIGSTOPped one does on any machine.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.client.client import KvpoolError
from kvpool.daemon.admission.admission import MAX_ADMIT_WAIT_S
from kvpool.router.router import Router
from kvpool.wire.protocol import Append, AppendReply, ErrorReply, Fork, Release
from tests.support.daemons import in_thread, joined, read_reply, result, sent_and_read, wait_until
from tests.support.fake_worker import expected_rows

MODES = {
    "process": (),
    "batched": ("--mode", "batched", "--seqs-per-worker", "1"),
}
TOKENS = [7, 3, 11, 5, 2, 9, 4, 8, 6, 1]


def _first_shard_daemon(serve, fake_shards, name: str, mode: str, *options: str):
    return serve(fake_shards[0], "--threads", "1", "--n-ctx", "64", "--max-sessions", "1", *MODES[mode], *options, name=f"{name}-{mode}")


def _refused(call) -> KvpoolError:
    with pytest.raises(KvpoolError) as refused:
        call()
    return refused.value


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_admission_that_waited_is_refused_once_a_higher_epoch_was_seen(serve, fake_shards, mode):
    """Append(B, 1, 0) waits in the admission line; Release(B, 2) is answered meanwhile. Before the fix the waiting
    epoch-1 append was admitted anyway and epoch 2 then ran on its KV (position_mismatch at 0, epoch 1's rows at 6)."""
    tokens = TOKENS
    daemon = _first_shard_daemon(serve, fake_shards, "admit", mode, "--spill-budget", "0")
    # a Client carries one request at a time: the waiting append has a client of its own
    with daemon.client() as client, daemon.client() as other, daemon.client() as waiting:
        other.append("holder", 1, 0, tokens=tokens[:4])
        with daemon.stopped("holder"):  # the holder's append stays in flight: the only place is busy
            holder = in_thread(lambda: other.append("holder", 1, 4, tokens=tokens[4:8]))
            wait_until(lambda: client.stats().sessions[0].in_flight, "the holder's append to be in flight")
            waiter = in_thread(lambda: waiting.append("B", 1, 0, tokens=tokens[:6], admit_timeout_s=MAX_ADMIT_WAIT_S))
            wait_until(lambda: client.stats().counters["admissions_waiting"] == 1, "B@1 to wait in the admission line")
            assert client.release("B", 2).detail == "no state"  # answered while B@1 still waits
        assert result(*holder).length == 8
        stale = joined(*waiter).get("error")
        assert isinstance(stale, KvpoolError) and stale.code == "stale_epoch", joined(*waiter)
        stats = client.stats()
        assert [row.session_id for row in stats.sessions] == ["holder"] and stats.integrity == "ok"
        # nothing of epoch 1 exists: it is refused, and epoch 2 starts from nothing
        assert _refused(lambda: client.append("B", 1, 6, tokens=tokens[6:7])).code == "stale_epoch"
        assert _refused(lambda: client.append("B", 2, 6, tokens=tokens[6:7])).code == "cache_miss"
        fresh = client.append("B", 2, 0, tokens=tokens[:3], admit_timeout_s=MAX_ADMIT_WAIT_S)
        assert fresh.admitted and fresh.length == 3
        step = client.append("B", 2, 3, tokens=tokens[3:4])
        assert step.length == 4 and np.array_equal(step.rows, expected_rows(client.hello.shard.shape, np.asarray(tokens[:4], np.int32))[3:])
        assert client.stats().integrity == "ok"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_bound_session_is_never_served_after_a_higher_epoch(serve, fake_shards, mode):
    """A session admitted at epoch 1: once epoch 2 is seen through another connection, an epoch-1 append on the
    first client is refused."""
    tokens = TOKENS
    daemon = _first_shard_daemon(serve, fake_shards, "bound", mode)
    with daemon.client() as client, daemon.client() as other:
        client.append("C", 1, 0, tokens=tokens[:4])
        client.append("C", 1, 4, tokens=tokens[4:5])
        assert other.release("C", 2).detail == "no state"  # epoch 2 seen: epoch 1's state released first
        assert _refused(lambda: client.append("C", 1, 5, tokens=tokens[5:6])).code == "stale_epoch"
        assert client.append("C", 2, 0, tokens=tokens[:2]).admitted
        assert client.stats().integrity == "ok"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_fork_that_waited_is_refused_once_its_new_id_saw_a_higher_epoch(serve, fake_shards, mode):
    """Fork(S -> F@1) waits for S's lock behind an append; Release(F, 2) is answered meanwhile. Before the fix F@1 was
    created parked anyway, and Append(F, 2, 6) restored and served it."""
    tokens = TOKENS
    daemon = _first_shard_daemon(serve, fake_shards, "fork", mode)
    with daemon.client() as client, daemon.client() as other:
        client.append("S", 1, 0, tokens=tokens[:6])
        with daemon.stopped("S"):  # S's append stays in flight, holding S's lock
            busy = in_thread(lambda: other.append("S", 1, 6, tokens=tokens[6:8]))
            wait_until(lambda: client.stats().sessions[0].in_flight, "S's append to be in flight")
            # once the daemon has read the Fork it is handling it: it waits for S's lock before anything later
            forker = sent_and_read(daemon.socket, Fork(session_id="S", epoch=1, new_session_id="F", new_epoch=1, length=6, request_id=7))
            assert client.release("F", 2).detail == "no state"
        assert result(*busy).length == 8
        refused = read_reply(forker)
        forker.close()
        assert isinstance(refused, ErrorReply) and refused.code == "stale_epoch", refused
        stats = client.stats()
        assert [row.session_id for row in stats.sessions] == ["S"] and stats.integrity == "ok"
        assert _refused(lambda: client.append("F", 2, 6, tokens=tokens[6:7])).code == "cache_miss"
        assert _refused(lambda: client.append("F", 1, 6, tokens=tokens[6:7])).code == "stale_epoch"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_fence_does_not_forget_with_traffic(serve, fake_shards, mode):
    """X reaches epoch 5 and is released; then more ids than the daemon remembers go by. Before the fix,
    Append(X, 3, 0) was then admitted; now the forgotten id is below the epoch floor, refused with the floor named."""
    tokens = TOKENS
    daemon = _first_shard_daemon(serve, fake_shards, "floor", mode, "--fence-ids", "4")
    with daemon.client() as client:
        client.append("X", 5, 0, tokens=tokens[:3])
        client.release("X", 5)
        assert _refused(lambda: client.append("X", 3, 0, tokens=tokens[:3])).code == "stale_epoch"
        for index in range(4):  # with X, one id more than --fence-ids, each at a higher epoch than X's
            client.release(f"other-{index}", 6)
        counters = client.stats().counters
        assert counters["epoch_floor"] == 5 and counters["fenced_ids"] <= 4
        stale = _refused(lambda: client.append("X", 3, 0, tokens=tokens[:3]))
        assert stale.code == "stale_epoch" and stale.reply.epoch_floor == 5
        assert _refused(lambda: client.append("new", 4, 0, tokens=tokens[:3])).reply.epoch_floor == 5
        assert client.append("new", 5, 0, tokens=tokens[:3]).admitted  # at the floor: a new session
        assert client.stats().integrity == "ok"


def test_the_router_starts_at_the_floor_a_daemon_names(serve, fake_model):
    """kvpool.router.router: a new session's first append refused below the daemon's epoch floor takes the floor's epoch
    and goes through, counted in RecoveryCounts.epoch_floor_restarts."""
    daemon = serve(fake_model, "--threads", "1", "--n-ctx", "64", "--max-sessions", "1", "--fence-ids", "2", name="floor-router")
    with daemon.client() as client:
        for index in range(4):
            client.release(f"churn-{index}", 3)
        assert client.stats().counters["epoch_floor"] == 3
        router = Router([client])
        session = router.session("fresh")  # epoch 1, below the floor
        logits = session.append(TOKENS[:5])
        assert logits.shape[0] == 1 and session.epoch == 3
        assert np.array_equal(logits, expected_rows(client.hello.shard.shape, np.asarray(TOKENS[:5], np.int32)))
        assert session.counts.epoch_floor_restarts == 1 and router.counts.epoch_floor_restarts == 1
        session.release()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_append_that_waited_for_a_compute_slot_is_refused_once_a_higher_epoch_was_seen(serve, fake_shards, mode):
    """B@1's append waits for the only compute slot (A's append holds it); Release(B, 2) is read meanwhile. Before the
    fix the epoch-1 append ran once the slot freed."""
    tokens = TOKENS
    daemon = serve(fake_shards[0], "--threads", "1", "--n-ctx", "64", "--max-sessions", "2", "--spill-budget", "0", *MODES[mode], name=f"slot-{mode}")
    with daemon.client() as client, daemon.client() as holder, daemon.client() as waiter:
        holder.append("A", 1, 0, tokens=tokens[:4])
        waiter.append("B", 1, 0, tokens=tokens[:4])
        with daemon.stopped("A"):  # A's append holds the only compute slot
            a_append = in_thread(lambda: holder.append("A", 1, 4, tokens=tokens[4:8]))
            wait_until(lambda: {r.session_id: r for r in client.stats().sessions}["A"].in_flight, "A's append to be in flight")
            b_append = in_thread(lambda: waiter.append("B", 1, 4, tokens=tokens[4:8]))
            wait_until(lambda: {r.session_id: r for r in client.stats().sessions}["B"].in_flight, "B's append to wait for the slot")
            releaser = sent_and_read(daemon.socket, Release(session_id="B", epoch=2, request_id=9))  # epoch 2 seen now
        assert result(*a_append).length == 8
        stale = joined(*b_append).get("error")
        assert isinstance(stale, KvpoolError) and stale.code == "stale_epoch", joined(*b_append)
        released = read_reply(releaser)
        releaser.close()
        assert released.detail == "no state", released  # epoch 1's state went with the fence; epoch 2 has none
        assert [row.session_id for row in client.stats().sessions] == ["A"]
        assert client.append("B", 2, 0, tokens=tokens[:3]).admitted
        assert client.stats().integrity == "ok"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_admission_of_the_newer_epoch_waits_for_the_fence_another_request_began(serve, fake_shards, mode):
    """Release(B, 2) fences epoch 1, which waits for B@1's append in flight (its worker stopped) before ending it; an
    admitting Append(B, 2, 0) read meanwhile waits for that fence. Before the fix it found epoch 1 still in the table
    and was answered cache_miss new_epoch; now it is admitted, with epoch 2's own history."""
    tokens = TOKENS
    daemon = _first_shard_daemon(serve, fake_shards, "window", mode, "--spill-budget", "0")
    with daemon.client() as client, daemon.client() as other:
        client.append("B", 1, 0, tokens=tokens[:4])
        with daemon.stopped("B"):
            in_flight = in_thread(lambda: client.append("B", 1, 4, tokens=tokens[4:6]))
            wait_until(lambda: other.stats().sessions[0].in_flight, "B@1's append to be in flight")
            releaser = sent_and_read(daemon.socket, Release(session_id="B", epoch=2, request_id=9))
            admitter = sent_and_read(daemon.socket, Append(session_id="B", epoch=2, start_pos=0, tokens=tokens[:3], request_id=10))
        joined(*in_flight)  # epoch 1's append: served or refused, either way before the fence ended it
        released = read_reply(releaser)
        admitted = read_reply(admitter)
        releaser.close()
        admitter.close()
        assert released.detail == "no state", released
        assert isinstance(admitted, AppendReply) and admitted.admitted and admitted.length == 3, admitted
        rows = np.frombuffer(admitted.data, np.float32).reshape(admitted.rows, admitted.width)
        assert np.array_equal(rows, expected_rows(client.hello.shard.shape, np.asarray(tokens[:3], np.int32)))  # every row: a first shard's
        stats = client.stats()
        assert [(row.session_id, row.epoch, row.length) for row in stats.sessions] == [("B", 2, 3)] and stats.integrity == "ok"
        assert stats.counters.get("misses", 0) == 0, stats.counters


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_older_epoch_a_failed_fence_left_is_ended_by_the_next_request_of_the_newer(serve, fake_shards, mode):
    """The fence of Release(B, 2) fails while ending B@1 (a fault injected into the daemon's drop, once): that request
    gets its error and B@1 stays in the table. The next request of epoch 2 ends B@1 itself before it is served: an
    append at 0 is admitted with epoch 2's own history (before, it met B@1 and was refused), and epoch 1 is stale."""
    tokens = TOKENS
    daemon = _first_shard_daemon(serve, fake_shards, "refence", mode, "--spill-budget", "0")
    lifecycle = daemon.supervisor.service.lifecycle
    drop, failures = lifecycle.drop, []

    async def failing_once(session, reason, **kwargs):
        if not failures:
            failures.append(reason)
            raise RuntimeError("injected: the fence's drop failed")
        return await drop(session, reason, **kwargs)

    with daemon.client() as client:
        client.append("B", 1, 0, tokens=tokens[:4])
        lifecycle.drop = failing_once
        try:
            assert _refused(lambda: client.release("B", 2)).code == "internal"
        finally:
            lifecycle.drop = drop
        assert failures == ["new_epoch"] and [(row.session_id, row.epoch) for row in client.stats().sessions] == [("B", 1)]
        admitted = client.append("B", 2, 0, tokens=tokens[:3])
        assert admitted.admitted and np.array_equal(admitted.rows, expected_rows(client.hello.shard.shape, np.asarray(tokens[:3], np.int32)))
        assert _refused(lambda: client.append("B", 1, 4, tokens=tokens[4:5])).code == "stale_epoch"
        stats = client.stats()
        assert [(row.session_id, row.epoch, row.length) for row in stats.sessions] == [("B", 2, 3)] and stats.integrity == "ok"

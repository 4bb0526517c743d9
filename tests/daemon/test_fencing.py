"""Epoch fencing under races and at volume (issue 17, items 1 and 2) on the direct channel, end to end on
real daemons (the supervisor's path, the fork, the router and the compute slot: tests/unit/test_fencing.py,
on fake workers).

The rule: once epoch e is seen for a session id, nothing of an epoch below e is created, served or exposed,
on any path (supervisor, direct channel, fork, restore). A request that waited (for admission, for a lock)
checks again after the wait. And the fence does not forget with traffic: a daemon remembers a bounded
number of ids and, past it, raises an epoch floor below which an id it does not know is stale.
"""

from __future__ import annotations

import pytest

from kvpool.client.client import KvpoolError
from kvpool.daemon.admission.admission import MAX_ADMIT_WAIT_S
from tests.support.daemons import DaemonProcess, in_thread, joined, result, stopped, wait_until

pytestmark = pytest.mark.timeout(3600)

MODES = {
    "process": (),
    "batched": ("--mode", "batched", "--seqs-per-worker", "1"),
}


def _first_shard_daemon(shards, socket_dir, name: str, mode: str, *options: str) -> DaemonProcess:
    return DaemonProcess(
        shards[0].path, socket_dir / f"{name}-{mode}.sock", "--threads", "1", "--n-ctx", "64", "--max-sessions", "1",
        *MODES[mode], *options,
    )


def _refused(call) -> KvpoolError:
    with pytest.raises(KvpoolError) as refused:
        call()
    return refused.value


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_admission_that_waited_is_refused_once_a_higher_epoch_was_seen(shards, socket_dir, prompt_ids, mode):
    """Append(B, 1, 0) waits in the admission line; Release(B, 2) is answered meanwhile. Before the fix the waiting
    epoch-1 append was admitted anyway and epoch 2 then ran on its KV (position_mismatch at 0, epoch 1's rows at 6)."""
    tokens = prompt_ids[1]
    daemon = _first_shard_daemon(shards, socket_dir, "admit", mode, "--spill-budget", "0")
    try:
        # a Client carries one request at a time: the waiting append has a client of its own
        with daemon.client(direct=True) as client, daemon.client(direct=False) as other, daemon.client(direct=True) as waiting:
            other.append("holder", 1, 0, tokens=tokens[:4])
            holder_pid = client.stats().sessions[0].worker_pid
            with stopped(holder_pid):  # the holder's append stays in flight: the only place is busy, on any machine
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
            # nothing of epoch 1 exists: it is refused on every path, and epoch 2 starts from nothing
            assert _refused(lambda: client.append("B", 1, 6, tokens=tokens[6:7])).code == "stale_epoch"
            assert _refused(lambda: client.append("B", 2, 6, tokens=tokens[6:7])).code == "cache_miss"
            fresh = client.append("B", 2, 0, tokens=tokens[:3], admit_timeout_s=MAX_ADMIT_WAIT_S)
            assert fresh.admitted and fresh.length == 3
            assert client.append("B", 2, 3, tokens=tokens[3:4]).length == 4
            assert client.stats().integrity == "ok"
    finally:
        daemon.stop()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_bound_session_is_never_served_after_a_higher_epoch(shards, socket_dir, prompt_ids, mode):
    """A session admitted and bound to its worker's channel at epoch 1: once epoch 2 is seen through another
    connection, an epoch-1 append on the first client is refused, though it travels on the channel."""
    tokens = prompt_ids[0]
    daemon = _first_shard_daemon(shards, socket_dir, "bound", mode)
    try:
        with daemon.client(direct=True) as client, daemon.client(direct=False) as other:
            client.append("C", 1, 0, tokens=tokens[:4])
            client.append("C", 1, 4, tokens=tokens[4:5])  # this one went over the channel
            assert other.release("C", 2).detail == "no state"  # epoch 2 seen: epoch 1's state released first
            assert _refused(lambda: client.append("C", 1, 5, tokens=tokens[5:6])).code == "stale_epoch"
            assert client.append("C", 2, 0, tokens=tokens[:2]).admitted
            assert client.stats().integrity == "ok"
    finally:
        daemon.stop()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_fence_does_not_forget_with_traffic(shards, socket_dir, prompt_ids, mode):
    """X reaches epoch 5 and is released; then more ids than the daemon remembers go by. Before the fix,
    Append(X, 3, 0) was then admitted; now the forgotten id is below the epoch floor, refused with the floor named."""
    tokens = prompt_ids[0]
    daemon = _first_shard_daemon(shards, socket_dir, "floor", mode, "--fence-ids", "4")
    try:
        with daemon.client(direct=True) as client:
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
    finally:
        daemon.stop()

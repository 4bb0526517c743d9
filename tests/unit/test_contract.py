"""The daemon's contract (README, "The contract") on fake workers, in both modes: every reply carries the
session's length, positions are checked, unknown sessions miss, epochs fence, release is idempotent,
truncate cuts, the context bounds, the budget admits, LRU evicts, the TTL expires, a lost worker loses its
session alone, cancel rolls back, and what each session gets back is its own history's rows bit for bit
(tests/support/fake_worker.expected_rows). Exactness on llama.cpp's numbers is tests/daemon's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvpool.client.client import KvpoolError
from kvpool.router.router import Router
from tests.support.contract import MODES, mode_flags, rows_of, tokens
from tests.support.daemons import refused, wait_until
from tests.support.fake_worker import expected_rows, fake_kinds

HANG_GUARD_S = 60.0  # a thread's join: the prefill it waits for takes two seconds












@pytest.mark.parametrize("mode", MODES)
def test_appends_return_their_own_historys_rows_and_every_reply_carries_the_length(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode)).client() as client:
        first = client.append("a", 1, 0, tokens=[5, 6, 7])
        assert (first.length, first.admitted) == (3, True) and np.array_equal(first.rows, rows_of(client, [5, 6, 7]))
        other = client.append("b", 1, 0, tokens=[5, 6])  # the same prefix in another session: its own context
        step = client.append("a", 1, 3, tokens=[8])
        assert (step.length, step.admitted) == (4, False) and np.array_equal(step.rows, rows_of(client, [5, 6, 7, 8]))
        assert np.array_equal(other.rows, rows_of(client, [5, 6]))
        assert client.append("b", 1, 2, tokens=[9]).length == 3
        mismatch = refused(lambda: client.append("a", 1, 2, tokens=[1]))
        assert (mismatch.code, mismatch.length) == ("position_mismatch", 4)
        assert client.truncate("a", 1, 2) == 2
        assert np.array_equal(client.append("a", 1, 2, tokens=[1]).rows, rows_of(client, [5, 6, 1]))  # a fresh history's
        assert {row.session_id: row.length for row in client.stats().sessions} == {"a": 3, "b": 3}


@pytest.mark.parametrize("mode", MODES)
def test_unknown_sessions_miss_position_zero_admits_and_release_is_idempotent(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode)).client() as client:
        missed = refused(lambda: client.append("nobody", 1, 4, tokens=[1]))
        assert (missed.code, missed.reason) == ("cache_miss", "unknown")
        client.append("s", 1, 0, tokens=[1, 2])
        reserved = client.stats().budget.reserved_bytes
        assert reserved > 0
        assert client.release("s", 1).detail == "released"
        assert client.release("s", 1).detail == "no state"
        assert client.stats().budget.reserved_bytes == 0
        released = refused(lambda: client.append("s", 1, 2, tokens=[3]))
        assert (released.code, released.reason) == ("cache_miss", "released")
        assert client.append("s", 1, 0, tokens=[3]).admitted


@pytest.mark.parametrize("mode", MODES)
def test_a_lower_epoch_is_stale_and_touches_nothing_a_higher_one_releases_the_old_state(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode)).client() as client:
        client.append("s", 2, 0, tokens=[1, 2, 3])
        stale = refused(lambda: client.append("s", 1, 0, tokens=[9]))
        assert stale.code == "stale_epoch"
        assert refused(lambda: client.truncate("s", 1, 0)).code == "stale_epoch"
        assert [(row.epoch, row.length) for row in client.stats().sessions] == [(2, 3)]
        newer = client.append("s", 3, 0, tokens=[4])
        assert newer.admitted and np.array_equal(newer.rows, rows_of(client, [4]))
        assert [(row.epoch, row.length) for row in client.stats().sessions] == [(3, 1)]
        assert refused(lambda: client.append("s", 2, 3, tokens=[4])).code == "stale_epoch"


@pytest.mark.parametrize("mode", MODES)
def test_the_context_bounds_a_session_and_bad_input_is_a_typed_error(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), "--n-ctx", "32").client() as client:
        client.append("s", 1, 0, tokens=list(range(30)))
        full = refused(lambda: client.append("s", 1, 30, tokens=[1, 2, 3]))
        assert (full.code, full.length) == ("context_full", 30)
        assert client.append("s", 1, 30, tokens=[1, 2]).length == 32
        assert refused(lambda: client.append("t", 1, 0, tokens=[1], n_ctx=33)).code == "bad_request"
        assert refused(lambda: client.append("t", 1, 0, tokens=[10_000])).code == "bad_request"  # beyond the vocabulary
        for wait in (-1.0, float("nan"), float("inf")):  # a wait for room: a finite number of seconds >= 0
            assert refused(lambda wait=wait: client.append("t", 1, 0, tokens=[1], admit_timeout_s=wait)).code == "bad_request"
        assert refused(lambda: client.truncate("s", 1, 33)).code == "position_mismatch"
        assert [row.session_id for row in client.stats().sessions] == ["s"]


def test_a_budget_for_one_session_evicts_the_least_recently_used_idle_one(serve, fake_model):
    # the warm tier off: an evicted session is gone (cache_miss evicted); two places, one session's budget
    daemon = serve(fake_model, "--spill-budget", "0", "--budget", "1.5MiB")
    with daemon.client() as client:
        client.append("old", 1, 0, tokens=[1])
        client.append("new", 1, 0, tokens=[2])
        evicted = refused(lambda: client.append("old", 1, 1, tokens=[3]))
        assert (evicted.code, evicted.reason) == ("cache_miss", "evicted")
        assert client.append("new", 1, 1, tokens=[3]).length == 2
        assert client.stats().counters["evictions"] >= 1


@pytest.mark.parametrize("mode", MODES)
def test_a_parked_session_restores_its_own_history_and_a_fork_continues_apart(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode)).client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3, 4])
        assert client.park("s", 1).detail == "parked"
        assert [row.tier for row in client.stats().sessions] == ["ram"]
        client.fork("s", 1, "f", 1, 2)
        restored = client.append("s", 1, 4, tokens=[5])
        assert restored.restored and np.array_equal(restored.rows, rows_of(client, [1, 2, 3, 4, 5]))
        forked = client.append("f", 1, 2, tokens=[9])
        assert forked.restored and np.array_equal(forked.rows, rows_of(client, [1, 2, 9]))


@pytest.mark.parametrize("mode", MODES)
def test_a_restore_request_makes_a_parked_session_hot_before_its_append_and_is_fenced_as_any(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), "--max-sessions", "2", "--min-residency", "0").client() as client:
        client.append("t", 1, 0, tokens=[7])
        client.append("s", 1, 0, tokens=[1, 2, 3])
        assert client.park("s", 1).detail == "parked"
        client.fork("s", 1, "f", 1, 2)  # parked from birth
        restored = client.restore("s", 1)
        assert (restored.detail, restored.length, restored.session_id, restored.epoch) == ("restored", 3, "s", 1)
        assert restored.channel == ""  # fake workers serve no direct channel (a batched one never does): none named
        stats = client.stats()
        assert {row.session_id: row.tier for row in stats.sessions} == {"t": "hot", "s": "hot", "f": "ram"}
        assert (stats.counters["restores"], stats.counters["restore_requests"]) == (1, 1)
        step = client.append("s", 1, 3, tokens=[4])  # computes at once: nothing left to restore
        assert not step.restored and np.array_equal(step.rows, rows_of(client, [1, 2, 3, 4]))
        assert (client.restore("s", 1).detail, client.stats().counters["restores"]) == ("hot", 1)  # a hot one as it is
        # both places taken: the fork's restore parks the least recently used idle session for room, as an append would
        assert client.restore("f", 1).detail == "restored"
        assert {row.session_id: row.tier for row in client.stats().sessions} == {"t": "ram", "s": "hot", "f": "hot"}
        assert np.array_equal(client.append("f", 1, 2, tokens=[9]).rows, rows_of(client, [1, 2, 9]))
        assert np.array_equal(client.append("t", 1, 1, tokens=[8]).rows, rows_of(client, [7, 8]))  # restored by its append
        # the contract's errors; a refused restore touches nothing
        tiers = {row.session_id: row.tier for row in client.stats().sessions}
        missed = refused(lambda: client.restore("nobody", 1))
        assert (missed.code, missed.reason) == ("cache_miss", "unknown")
        assert refused(lambda: client.restore("s", 0)).code == "stale_epoch"
        for wait in (-1.0, float("nan")):
            assert refused(lambda wait=wait: client.restore("s", 1, admit_timeout_s=wait)).code == "bad_request"
        assert {row.session_id: row.tier for row in client.stats().sessions} == tiers
        client.release("s", 1)
        released = refused(lambda: client.restore("s", 1))
        assert (released.code, released.reason) == ("cache_miss", "released")
        newer = refused(lambda: client.restore("f", 2))  # a newer epoch releases the old one's state, and admits nothing
        assert (newer.code, newer.reason) == ("cache_miss", "new_epoch")
        assert [row.session_id for row in client.stats().sessions] == ["t"]


@pytest.mark.parametrize("mode", MODES)
def test_more_sessions_than_places_park_and_come_back_exactly(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), "--max-sessions", "2", "--min-residency", "0").client() as client:
        histories = {f"s{index}": [index + 1] for index in range(5)}
        for session, history in histories.items():
            client.append(session, 1, 0, tokens=history)
        for step in range(3):
            for session, history in histories.items():
                reply = client.append(session, 1, len(history), tokens=[50 + step])
                history.append(50 + step)
                assert np.array_equal(reply.rows, rows_of(client, history)), session
        stats = client.stats()
        assert sum(row.tier == "hot" for row in stats.sessions) <= 2 and stats.counters["spills"] >= 3


def test_idle_sessions_expire_after_the_ttl(serve, fake_model):
    with serve(fake_model, "--ttl", "0.2").client() as client:
        client.append("s", 1, 0, tokens=[1])
        wait_until(lambda: not client.stats().sessions, "the idle session's expiry")
        expired = refused(lambda: client.append("s", 1, 1, tokens=[2]))
        assert (expired.code, expired.reason) == ("cache_miss", "expired")


@pytest.mark.parametrize("mode", MODES)
def test_a_lost_worker_loses_its_sessions_alone_and_is_replaced(serve, fake_model, mode):
    """A worker that dies (as SIGKILL ends one) loses the sessions it held, each answered worker_lost on its
    next request: in process mode one session, in batched mode the sequences of that one process; every
    other session continues on its own history, and a fresh worker takes the place."""
    daemon = serve(fake_model, *mode_flags(mode), "--max-sessions", "4")
    with daemon.client() as client:
        for session in ("a", "b", "c", "d"):
            client.append(session, 1, 0, tokens=[1, 2])
        service = daemon.supervisor.service

        def process_of(session: str):
            worker = service.pool.get(service.books.table.get(session).worker_name)
            return worker if mode == "process" else worker.process

        killed = process_of("a")
        doomed = {session for session in ("a", "b", "c", "d") if process_of(session) is killed}
        assert len(doomed) == (1 if mode == "process" else 2)
        killed.process.kill()
        for session in ("a", "b", "c", "d"):
            if session in doomed:
                assert refused(lambda: client.append(session, 1, 2, tokens=[3])).code == "worker_lost"
            else:
                assert np.array_equal(client.append(session, 1, 2, tokens=[3]).rows, rows_of(client, [1, 2, 3]))
        assert {row.session_id for row in client.stats().sessions} == {"a", "b", "c", "d"} - doomed
        assert client.append("a", 1, 0, tokens=[7]).admitted  # a fresh worker serves again
        wait_until(lambda: all(not worker.lost for worker in service.pool.workers()), "the replacement")


@pytest.mark.parametrize("mode", MODES)
def test_cancel_aborts_an_append_in_flight_and_the_session_rolls_back(serve, fake_model, mode):
    kinds = fake_kinds()
    daemon = serve(fake_model, *mode_flags(mode), kinds=kinds)
    with daemon.client() as client, daemon.client() as other:
        client.append("s", 1, 0, tokens=[1, 2])
        kinds[0].behaviour.row_delay_s = 0.05  # from now on a 40-row prefill takes 2 s: the cancel meets it
        outcome: dict[str, object] = {}

        def prefill() -> None:
            try:
                outcome["reply"] = client.append("s", 1, 2, tokens=list(range(3, 43)))
            except KvpoolError as error:
                outcome["error"] = error

        thread = threading.Thread(target=prefill)
        thread.start()
        wait_until(lambda: any(row.in_flight for row in other.stats().sessions), "the prefill in flight")
        assert other.cancel("s", 1).detail == "cancel requested"
        thread.join(HANG_GUARD_S)
        assert "error" in outcome and outcome["error"].code == "cancelled", outcome
        assert outcome["error"].length == 2
        assert np.array_equal(other.append("s", 1, 2, tokens=[9]).rows, rows_of(client, [1, 2, 9]))


@pytest.mark.parametrize("mode", MODES)
def test_a_chain_of_three_fake_shards_composes_through_the_router(serve, fake_shards, mode):
    daemons = [serve(path, *mode_flags(mode), name=f"chain{index}") for index, path in enumerate(fake_shards)]
    clients = [daemon.client() for daemon in daemons]
    try:
        session = Router(clients).session("routed")
        prompt = [3, 1, 4, 1, 5]
        logits = session.append(prompt)
        rows = tokens(*prompt)
        for client in clients:
            rows = expected_rows(client.hello.shard.shape, rows, output_rows="all")
        assert np.array_equal(logits[-1], rows[-1])
        session.release()
        assert all(not client.stats().sessions for client in clients)
    finally:
        for client in clients:
            client.close()

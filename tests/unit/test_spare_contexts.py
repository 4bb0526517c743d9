"""Spare contexts on fake workers (process mode): a parked or released session's worker keeps the context,
charged apart from the sessions; the session's restore, or the next admission of that n_ctx, takes it;
spares are the first room an admission takes; what each session gets back stays its own history's rows
(tests/support/fake_worker.expected_rows). The same on llama.cpp's numbers: tests/daemon/test_warm_tier.py.
And a route's park (kvpool.router.route.Route.park): every daemon at once, a failing stage raised after all."""

from __future__ import annotations

import contextlib
import gc
import select
import time

import numpy as np
import pytest

from kvpool.router.route import Route, StageFailed
from kvpool.state.shared import SharedState
from kvpool.wire.protocol import Append, AppendReply, Done, Release
from tests.support.contract import rows_of
from tests.support.daemons import checked, in_thread, read_reply, refused, result, sent_and_read, wait_until
from tests.support.fake_worker import fake_kinds
from workers.server.commands import Failed, RunAppend
from workers.server.single import IDLE_ZERO_S


def _budget(client):
    return checked(client).budget


def test_a_park_keeps_the_context_as_a_charged_spare_and_the_restore_takes_it(serve, fake_model):
    with serve(fake_model, "--max-sessions", "2").client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3, 4])
        charge = client.stats().sessions[0].charged_bytes
        assert client.park("s", 1).detail == "parked"
        budget = _budget(client)
        assert (budget.reserved_bytes, budget.spare_bytes) == (0, charge)
        assert sorted((row.state, row.spare_bytes) for row in client.stats().workers) == [("free", 0), ("free", charge)]
        restored = client.append("s", 1, 4, tokens=[5])
        assert restored.restored and np.array_equal(restored.rows, rows_of(client, [1, 2, 3, 4, 5]))
        stats = client.stats()
        assert stats.counters["restores_into_spare"] == 1 and stats.counters.get("spares_freed", 0) == 0
        assert stats.counters["restores_in_place"] == 1  # its own park's cells, resumed: the blob not read
        assert (_budget(client).reserved_bytes, _budget(client).spare_bytes) == (charge, 0)
        client.release("s", 1)
        assert (_budget(client).reserved_bytes, _budget(client).spare_bytes) == (0, charge)  # a release keeps its context too
        assert client.stats().counters["spares_kept"] == 1


def test_a_released_or_superseded_sessions_context_is_the_next_admissions_of_its_n_ctx_each_a_fresh_history(serve, fake_model):
    """A release, or a newer epoch that ends the old one, leaves the context as the worker's spare (charged
    under its own name); the next admission of that n_ctx takes it (admissions_into_spare) and computes a fresh
    history, never the ended one's; an admission of another n_ctx frees it and creates its own."""
    with serve(fake_model, "--max-sessions", "1", "--n-ctx", "64").client() as client:
        client.append("a", 1, 0, tokens=[1, 2, 3])
        charge = client.stats().sessions[0].charged_bytes
        assert client.release("a", 1).detail == "released"
        stats = checked(client)
        assert (stats.budget.reserved_bytes, stats.budget.spare_bytes) == (0, charge)
        assert [(row.state, row.spare_bytes) for row in stats.workers] == [("free", charge)]
        assert (stats.counters["spares_kept"], stats.counters.get("admissions_into_spare", 0)) == (1, 0)
        fresh = client.append("b", 1, 0, tokens=[1, 2])  # a's history's first two tokens: the rows must not be a's
        assert fresh.admitted and np.array_equal(fresh.rows, rows_of(client, [1, 2]))
        stats = checked(client)
        assert (stats.budget.reserved_bytes, stats.budget.spare_bytes) == (charge, 0)
        assert stats.counters["admissions_into_spare"] == 1
        newer = client.append("b", 2, 0, tokens=[7])  # epoch 2 ends epoch 1: its context is the new epoch's
        assert newer.admitted and np.array_equal(newer.rows, rows_of(client, [7]))
        stats = checked(client)
        assert (stats.counters["spares_kept"], stats.counters["admissions_into_spare"]) == (2, 2)
        assert (stats.budget.reserved_bytes, stats.budget.spare_bytes) == (charge, 0)
        client.release("b", 2)
        other = client.append("c", 1, 0, tokens=[5], n_ctx=32)  # another n_ctx: the spare is freed, a context created
        assert other.admitted and np.array_equal(other.rows, rows_of(client, [5]))
        stats = checked(client)
        small = stats.sessions[0].charged_bytes
        assert stats.counters["admissions_into_spare"] == 2 and (stats.budget.reserved_bytes, stats.budget.spare_bytes) == (small, 0)


def test_an_expired_session_frees_its_context_and_a_batched_release_keeps_no_spare(serve, fake_model):
    with serve(fake_model, "--ttl", "0.3").client() as client:
        client.append("idle", 1, 0, tokens=[1, 2])
        wait_until(lambda: not client.stats().sessions, "the idle session's expiry")
        stats = checked(client)
        assert (stats.budget.reserved_bytes, stats.budget.spare_bytes) == (0, 0)  # idle past its TTL: the memory goes back
        assert stats.counters.get("spares_kept", 0) == 0 and stats.counters["expirations"] == 1
    with serve(fake_model, "--mode", "batched", "--seqs-per-worker", "2", name="batched").client() as client:
        client.append("s", 1, 0, tokens=[1, 2])
        client.release("s", 1)
        stats = checked(client)
        assert (stats.budget.reserved_bytes, stats.budget.spare_bytes) == (0, 0)  # its sequence emptied where it is
        assert stats.counters.get("spares_kept", 0) == 0
        again = client.append("t", 1, 0, tokens=[1])
        assert again.admitted and np.array_equal(again.rows, rows_of(client, [1]))


def test_one_place_serves_two_sessions_through_each_others_spares_each_its_own_history(serve, fake_model):
    with serve(fake_model, "--max-sessions", "1", "--min-residency", "0").client() as client:
        histories = {"a": [1, 2, 3], "b": [7, 8]}
        client.append("a", 1, 0, tokens=histories["a"])
        client.park("a", 1)
        fresh = client.append("b", 1, 0, tokens=histories["b"])  # admitted into a's spare: a fresh history's rows
        assert fresh.admitted and np.array_equal(fresh.rows, rows_of(client, histories["b"]))
        for step in range(3):
            for name, history in histories.items():
                reply = client.append(name, 1, len(history), tokens=[40 + step])  # the other one is parked for it
                history.append(40 + step)
                assert reply.restored and np.array_equal(reply.rows, rows_of(client, history)), (name, step)
        stats = checked(client)
        assert stats.counters["restores_into_spare"] == stats.counters["restores"] == 6 and stats.counters["misses"] == 0
        assert stats.counters.get("restores_in_place", 0) == 0  # each into the other's spare: loaded from its blob


def test_a_session_truncated_while_parked_resumes_its_own_cells_cut_and_a_new_one_of_the_same_key_does_not(serve, fake_model):
    with serve(fake_model, "--max-sessions", "1").client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3, 4, 5])
        client.park("s", 1)
        assert client.truncate("s", 1, 3) == 3  # parked: its stored state is resealed at 3
        reply = client.append("s", 1, 3, tokens=[9])
        assert reply.restored and np.array_equal(reply.rows, rows_of(client, [1, 2, 3, 9]))
        assert client.stats().counters["restores_in_place"] == 1
        client.park("s", 1)
        client.release("s", 1)  # the spare still holds its cells, but no session names that park any more
        client.append("s", 1, 0, tokens=[1, 2, 3, 9, 10])
        client.park("s", 1)
        reply = client.append("s", 1, 5, tokens=[11])
        assert reply.restored and np.array_equal(reply.rows, rows_of(client, [1, 2, 3, 9, 10, 11]))
        assert checked(client).counters["restores_in_place"] == 2  # this park's own cells, not the released one's


def test_a_restore_after_the_spare_was_zeroed_loads_the_state_into_it(serve, fake_model):
    with serve(fake_model, "--max-sessions", "1").client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3])
        client.park("s", 1)
        time.sleep(IDLE_ZERO_S + 0.2)  # the worker idle that long zeroes its spare
        reply = client.append("s", 1, 3, tokens=[4])
        assert reply.restored and np.array_equal(reply.rows, rows_of(client, [1, 2, 3, 4]))
        counters = checked(client).counters
        assert counters["restores_into_spare"] == 1 and counters.get("restores_in_place", 0) == 0  # loaded from the blob


def test_spares_are_freed_for_room_before_any_session_is_evicted(serve, fake_model):
    with serve(fake_model, "--max-sessions", "3", "--n-ctx", "64").client() as client:
        client.append("probe", 1, 0, tokens=[1])
        charge = client.stats().sessions[0].charged_bytes
        client.release("probe", 1)
    with serve(fake_model, "--max-sessions", "3", "--n-ctx", "64", "--budget", str(charge * 2), "--min-residency", "0", name="two").client() as client:
        for name in ("a", "b"):  # both hot, then both parked: two spares fill the budget
            client.append(name, 1, 0, tokens=[3, 4])
        for name in ("a", "b"):
            client.park(name, 1)
        assert (_budget(client).reserved_bytes, _budget(client).spare_bytes) == (0, 2 * charge)
        small = client.append("c", 1, 0, tokens=[5], n_ctx=32)  # no spare of its n_ctx: one spare is freed for it
        assert small.admitted and np.array_equal(small.rows, rows_of(client, [5]))
        stats = client.stats()
        assert stats.counters["spares_freed"] == 1 and stats.counters.get("evictions", 0) == 0
        assert sorted(row.tier for row in stats.sessions) == ["hot", "ram", "ram"]
        small_charge = next(row.charged_bytes for row in stats.sessions if row.session_id == "c")
        assert (_budget(client).reserved_bytes, _budget(client).spare_bytes) == (small_charge, charge)
        back = client.append("a", 1, 2, tokens=[6])  # into the spare left: no eviction either
        assert back.restored and np.array_equal(back.rows, rows_of(client, [3, 4, 6]))
        stats = checked(client)
        assert stats.counters["restores_into_spare"] == 1 and stats.counters.get("evictions", 0) == 0


def test_a_route_parks_on_every_daemon_at_once_and_a_failing_stage_is_raised_after_all_answered(serve, fake_shards):
    daemons = [serve(path, "--max-sessions", "2", name=f"stage{index}") for index, path in enumerate(fake_shards)]
    clients = [daemon.client() for daemon in daemons]
    try:
        for client in clients:
            client.__enter__()
        route = Route(clients)
        first = route.append("s", 1, 0, [1, 2, 3])
        assert [reply.detail for reply in route.park("s", 1)] == ["parked"] * 3
        assert all([row.tier for row in checked(client).sessions] == ["ram"] for client in clients)
        assert np.array_equal(route.append("s", 1, 3, [4]), route.append("t", 1, 0, [1, 2, 3, 4])[-1:]) and first.shape[0] == 1
        clients[1].release("s", 1)  # the middle daemon no longer holds the session: its stage fails, the others park
        with pytest.raises(StageFailed) as failed:
            route.park("s", 1)
        assert failed.value.stage == 1 and failed.value.reply.code == "cache_miss"
        assert [[row.tier for row in checked(client).sessions if row.session_id == "s"] for client in clients] == [["ram"], [], ["ram"]]
    finally:
        for client in clients:
            client.__exit__(None, None, None)


@pytest.mark.parametrize("by", ["append", "restore"])
def test_a_restore_that_finds_no_room_puts_the_state_back_and_comes_back_later(serve, fake_model, by):
    kinds = fake_kinds()
    daemon = serve(fake_model, "--max-sessions", "1", kinds=kinds)
    with daemon.client() as client, daemon.client() as other:
        client.append("parked", 1, 0, tokens=[1, 2, 3])
        client.park("parked", 1)
        client.append("busy", 1, 0, tokens=[4])  # into the parked session's spare: the one place
        spill = client.stats().budget.spill_bytes
        kinds[0].behaviour.row_delay_s = 0.05  # from now on a 40-row append takes 2 s: the place stays busy
        busy = in_thread(lambda: other.append("busy", 1, 1, tokens=list(range(40))))
        wait_until(lambda: any(row.in_flight for row in client.stats().sessions), "the busy session's append in flight")

        def restore(wait_s: float):  # the append that restores it, or a Restore before that append
            if by == "append":
                return client.append("parked", 1, 3, tokens=[5], admit_timeout_s=wait_s)
            return client.restore("parked", 1, admit_timeout_s=wait_s)

        full = refused(lambda: restore(0.0))
        assert (full.code, full.length) == ("over_budget", 3)  # the session's length, as every reply carries it
        stats = checked(client)  # the state went back to the store: the session is still parked, whole
        assert {row.session_id: row.tier for row in stats.sessions} == {"parked": "ram", "busy": "hot"}
        assert stats.budget.spill_bytes == spill and stats.counters.get("restores", 0) == 0
        kinds[0].behaviour.row_delay_s = 0.0
        assert result(*busy).length == 41
        came_back = restore(10.0)  # parks "busy", idle now, for the place
        assert {row.session_id: row.tier for row in checked(client).sessions} == {"parked": "hot", "busy": "ram"}
        back = came_back if by == "append" else client.append("parked", 1, 3, tokens=[5])
        assert back.restored == (by == "append") and np.array_equal(back.rows, rows_of(client, [1, 2, 3, 5]))


def test_a_park_after_idle_time_frees_the_context_and_keeps_no_spare(serve, fake_model):
    with serve(fake_model, "--park-after", "0.2").client() as client:
        client.append("idle", 1, 0, tokens=[1, 2])
        wait_until(lambda: [row.tier for row in client.stats().sessions] == ["ram"], "the idle session's park")
        budget = _budget(client)
        assert (budget.reserved_bytes, budget.spare_bytes) == (0, 0)  # idle: its memory goes back
        assert np.array_equal(client.append("idle", 1, 2, tokens=[3]).rows, rows_of(client, [1, 2, 3]))


def test_a_route_park_does_not_wait_for_one_daemon_before_the_next(serve, fake_shards):
    daemons = [serve(path, name=f"at-once{index}") for index, path in enumerate(fake_shards)]
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(daemon.client()) for daemon in daemons]
        watchers = [stack.enter_context(daemon.client()) for daemon in daemons]
        route = Route(clients)
        route.append("s", 1, 0, [1, 2, 3])
        with daemons[0].stopped():  # the first daemon's worker takes no command: its park waits there
            parking = in_thread(lambda: route.park("s", 1))
            wait_until(lambda: all([row.tier for row in watcher.stats().sessions] == ["ram"] for watcher in watchers[1:]),
                       "the other daemons parked while the first one waits")
            assert [row.tier for row in watchers[0].stats().sessions] == ["hot"] and parking[0].is_alive()
        assert [reply.detail for reply in result(*parking)] == ["parked"] * 3


def test_a_parked_state_stays_in_the_memory_its_worker_wrote_until_the_restore_takes_it(serve, fake_model):
    """Long enough for a park's room (over 64 KiB of state): the state is kept as the worker's memfd
    (kvpool.state.shared), one per parked session, and freed once restored or released."""
    tokens = [t % 97 + 1 for t in range(1100)]
    with serve(fake_model, "--max-sessions", "2", "--n-ctx", "2048").client() as client:
        gc.collect()  # an earlier test's garbage freed now, not between the counts below
        before = SharedState.open_count()
        for session_id in ("a", "b"):
            client.append(session_id, 1, 0, tokens=tokens)
            assert client.park(session_id, 1).detail == "parked"
        assert SharedState.open_count() == before + 2
        restored = client.append("a", 1, len(tokens), tokens=[5])
        assert restored.restored and np.array_equal(restored.rows, rows_of(client, tokens + [5]))
        assert SharedState.open_count() == before + 1
        client.release("b", 1)
        assert SharedState.open_count() == before


def test_a_restore_travels_with_its_append_and_a_refusal_of_it_ends_the_session_alone(serve, fake_model):
    kinds = fake_kinds()
    daemon = serve(fake_model, "--max-sessions", "2", kinds=kinds)
    sent: list = []

    def watch(command):
        sent.append(type(command).__name__ + ("+restore" if getattr(command, "restore", None) is not None else ""))
        if isinstance(command, RunAppend) and command.restore is not None and command.start_pos == 2:
            return Failed(code="restore_failed", message="refused by the test")
        return None

    with daemon.client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3])
        client.append("t", 1, 0, tokens=[1, 2])
        client.park("s", 1)
        client.park("t", 1)
        kinds[0].behaviour.fail = watch
        back = client.append("s", 1, 3, tokens=[4])
        assert back.restored and np.array_equal(back.rows, rows_of(client, [1, 2, 3, 4]))
        assert sent == ["RunAppend+restore"]  # one round trip: no RestoreState of its own
        missed = refused(lambda: client.append("t", 1, 2, tokens=[9]))
        assert (missed.code, missed.reason) == ("cache_miss", "restore_failed")
        kinds[0].behaviour.fail = None
        stats = checked(client)
        assert [row.session_id for row in stats.sessions] == ["s"] and stats.counters["restore_failures"] == 1
        too_long = refused(lambda: client.append("s", 1, 4, tokens=list(range(5000))))  # refused before anything: nothing restored
        assert too_long.code in ("bad_request", "position_mismatch")


def test_a_session_ended_by_a_newer_epoch_is_not_evicted_while_its_worker_keeps_its_context(serve, fake_model):
    """The newer epoch's fence counts no request of the old one; while the old one's worker keeps its context
    (the worker held), another admission finds no idle session to evict and waits; then each session computes
    its own history: the context kept is zeroed before the one that takes it."""
    daemon = serve(fake_model, "--max-sessions", "1", "--spill-budget", "0", "--min-residency", "0")
    with daemon.client() as client, daemon.client() as other, daemon.client() as watcher:
        client.append("a", 1, 0, tokens=[1, 2, 3])
        with daemon.stopped():
            newer = in_thread(lambda: client.append("a", 2, 0, tokens=[1, 2], admit_timeout_s=30))
            wait_until(lambda: [(row.epoch, row.in_flight) for row in watcher.stats().sessions] == [(1, True)], "the old epoch held while its context is kept")
            queued = in_thread(lambda: other.append("b", 1, 0, tokens=[9], admit_timeout_s=30))
            wait_until(lambda: watcher.stats().counters["admissions_waiting"] == 1, "the other admission waiting for a place")
            assert watcher.stats().counters.get("evictions", 0) == 0  # the old epoch, busy, is nobody's victim
        replies = {"a": result(*newer), "b": result(*queued)}
        assert np.array_equal(replies["a"].rows, rows_of(client, [1, 2])) and np.array_equal(replies["b"].rows, rows_of(client, [9]))
        counters = checked(client).counters
        assert counters["spares_kept"] == 1 and counters["admissions_into_spare"] >= 1


def test_a_release_whose_admission_never_opened_a_context_keeps_no_spare(serve, fake_model):
    """An admitting append refused before it reached the worker (more rows than its n_ctx) leaves the session
    bound with no context opened; its release keeps nothing (the worker refuses the keep: no_context), so the books
    hold no spare the worker does not have, and the worker's own spare, given up for that admission, is freed."""
    with serve(fake_model, "--max-sessions", "1", "--n-ctx", "64").client() as client:
        client.append("s", 1, 0, tokens=[1, 2])
        client.release("s", 1)  # a spare of n_ctx 64 on the one worker
        failed = refused(lambda: client.append("a", 1, 0, tokens=list(range(1, 9)), n_ctx=4))
        assert (failed.code, failed.length) == ("context_full", 0), failed
        client.release("a", 1)
        stats = checked(client)
        assert (stats.budget.reserved_bytes, stats.budget.spare_bytes) == (0, 0) and stats.counters["spares_kept"] == 1
        assert [(row.state, row.spare_bytes) for row in stats.workers] == [("free", 0)]
        again = client.append("b", 1, 0, tokens=[3], n_ctx=64)  # a context created: no spare left anywhere
        assert again.admitted and np.array_equal(again.rows, rows_of(client, [3]))
        assert checked(client).counters.get("admissions_into_spare", 0) == 0


def test_a_spare_no_admission_takes_within_the_ttl_is_freed(serve, fake_model):
    with serve(fake_model, "--max-sessions", "2", "--ttl", "0.5").client() as client:
        client.append("s", 1, 0, tokens=[1, 2])
        client.release("s", 1)
        assert client.stats().counters["spares_kept"] == 1  # kept (read as a count: on a slow machine the TTL may be past already)
        wait_until(lambda: _budget(client).spare_bytes == 0, "the idle spare freed")
        stats = checked(client)
        assert stats.counters["spares_expired"] == 1 and all(row.state == "free" and row.spare_bytes == 0 for row in stats.workers)
        again = client.append("t", 1, 0, tokens=[1, 2])
        assert again.admitted and np.array_equal(again.rows, rows_of(client, [1, 2]))
        assert checked(client).counters.get("admissions_into_spare", 0) == 0



@pytest.mark.parametrize("second", ["append", "release"])
def test_a_second_request_of_the_newer_epoch_waits_while_the_old_ones_worker_keeps_its_context(serve, fake_model, second):
    """The first request of epoch 2 fences epoch 1, whose worker keeps the context (the worker held here); a second
    request of epoch 2, read meanwhile, waits for that fence instead of finding epoch 1 still in the table (before the
    fix an append at 0 was answered cache_miss new_epoch, a release "released" what the fence was ending). Then it
    is served as epoch 2's own: the append admitted into the context kept, with epoch 2's history only."""
    daemon = serve(fake_model, "--max-sessions", "2", "--spill-budget", "0")
    with daemon.client() as client, daemon.client() as watcher:
        client.append("a", 1, 0, tokens=[1, 2, 3])
        with daemon.stopped("a"):
            first = in_thread(lambda: client.release("a", 2))
            wait_until(lambda: [(row.epoch, row.in_flight) for row in watcher.stats().sessions] == [(1, True)], "the old epoch held while its context is kept")
            request = Append(session_id="a", epoch=2, start_pos=0, tokens=[4, 5], admit_timeout_s=30) if second == "append" else Release(session_id="a", epoch=2)
            late = sent_and_read(daemon.socket, request)
            assert not select.select([late], [], [], 0.2)[0]  # no answer while the fence is under way
        assert result(*first).detail == "no state"
        reply = read_reply(late)
        late.close()
        if second == "append":
            assert isinstance(reply, AppendReply) and reply.admitted and reply.length == 2, reply
            assert np.array_equal(np.frombuffer(reply.data, np.float32).reshape(reply.rows, reply.width), rows_of(client, [4, 5])[-1:]), reply
        else:
            assert isinstance(reply, Done) and reply.detail == "no state", reply
        counters = checked(client).counters
        assert counters["spares_kept"] == 1 and counters.get("misses", 0) == 0, counters
        assert counters.get("admissions_into_spare", 0) == (second == "append")


def test_a_worker_lost_while_it_keeps_a_released_context_ends_the_session_and_is_replaced(serve, fake_model):
    """The release's keep meets a worker that dies (as SIGKILL ends one) while the CloseContext is in flight: the
    session ends as a release without keep does, no spare is booked for the dead worker, a fresh worker takes the
    place, and the next admission computes its own history there."""
    daemon = serve(fake_model, "--max-sessions", "1", "--spill-budget", "0")
    service = daemon.supervisor.service
    with daemon.client() as client, daemon.client() as watcher:
        client.append("a", 1, 0, tokens=[1, 2, 3])
        worker = service.pool.get(service.books.table.get("a").worker_name)
        with daemon.stopped("a"):
            released = in_thread(lambda: client.release("a", 1))
            wait_until(lambda: [(row.session_id, row.in_flight) for row in watcher.stats().sessions] == [("a", True)], "the release's keep in flight")
            worker.process.kill()
        assert result(*released).detail == "released"
        wait_until(lambda: all(not each.lost for each in service.pool.workers()), "the replacement")
        stats = checked(client)
        assert stats.sessions == [] and stats.budget.spare_bytes == 0 and stats.counters.get("spares_kept", 0) == 0, stats
        again = client.append("b", 1, 0, tokens=[4, 5])
        assert again.admitted and np.array_equal(again.rows, rows_of(client, [4, 5]))
        assert checked(client).counters.get("admissions_into_spare", 0) == 0

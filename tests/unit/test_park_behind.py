"""A Park that does not wait for its save (Park.wait false, kvpool.daemon.warm.WarmRequests._finish_park), on
fake workers in both modes: answered "parking" while its worker has not saved (the worker is stopped, so a
reply that waited could not come), the save finishing behind it holding the session, so that every later
request on the session - an append that restores it, a Park that waits, a release, a newer epoch - waits for
the save and then sees the session parked, with its own history's rows; a save that fails ends the session
(its next append a cache miss). And a route's park without wait (kvpool.router.route.Route.park): every
daemon's request sent before any answer is read (kvpool.client.client.Client.ask_all, which each call's
result or error comes back from, in order)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.client.messages import park_call, release_call
from kvpool.daemon.pool.handle import WorkerHandle
from kvpool.router.route import Route, StageFailed
from tests.support.contract import rows_of
from tests.support.daemons import checked, in_thread, refused, result, wait_until
from tests.support.fake_worker import fake_kinds
from workers.server.commands import Failed, SaveState

MODES = {"process": (), "batched": ("--mode", "batched", "--seqs-per-worker", "2")}


def _row(client, session: str):
    return next((row for row in client.stats().sessions if row.session_id == session), None)


def _in_flight(daemon, session_id: str) -> int:
    """Requests on the session, the park's save among them (the daemon's own count: status says only yes or no)."""
    session = daemon.supervisor.service.books.table.get(session_id)
    return 0 if session is None else session.in_flight


@pytest.mark.parametrize("mode", MODES)
def test_answered_before_its_save_and_the_next_append_waits_for_it_then_restores(serve, fake_model, mode):
    daemon = serve(fake_model, "--max-sessions", "2", *MODES[mode])
    with daemon.client() as client, daemon.client() as other:
        client.append("s", 1, 0, tokens=[1, 2, 3, 4])
        with daemon.stopped("s"):
            reply = client.park("s", 1, wait=False)  # its worker is stopped: the state cannot have been saved yet
            assert (reply.detail, reply.length) == ("parking", 4)
            assert (_row(client, "s").tier, _in_flight(daemon, "s")) == ("hot", 1)  # the save holds the session
            appending = in_thread(lambda: other.append("s", 1, 4, tokens=[5]))
            wait_until(lambda: _in_flight(daemon, "s") == 2, "the append waiting for the save")
            assert appending[0].is_alive()
        restored = result(*appending)
        assert restored.restored and np.array_equal(restored.rows, rows_of(client, [1, 2, 3, 4, 5]))
        counters = checked(client).counters
        assert (counters["parks"], counters["restores"], counters.get("misses", 0)) == (1, 1, 0)


@pytest.mark.parametrize("mode", MODES)
def test_a_waiting_park_after_it_answers_once_the_state_is_in_the_store(serve, fake_model, mode):
    daemon = serve(fake_model, "--max-sessions", "2", *MODES[mode])
    with daemon.client() as client, daemon.client() as other:
        client.append("s", 1, 0, tokens=[1, 2, 3])
        spill_before = client.stats().budget.spill_bytes
        with daemon.stopped("s"):
            assert client.park("s", 1, wait=False).detail == "parking"
            waiting = in_thread(lambda: other.park("s", 1))
            wait_until(lambda: _in_flight(daemon, "s") == 2, "the waiting park behind the save")
            assert waiting[0].is_alive()
        assert result(*waiting).detail == "already parked"
        stats = checked(client)
        assert _row(client, "s").tier == "ram" and stats.budget.spill_bytes > spill_before and stats.counters["parks"] == 1
        back = client.append("s", 1, 3, tokens=[9])
        assert back.restored and np.array_equal(back.rows, rows_of(client, [1, 2, 3, 9]))


def test_a_release_and_a_newer_epoch_wait_for_the_save_and_leave_nothing_behind(serve, fake_model):
    daemon = serve(fake_model, "--max-sessions", "2")
    with daemon.client() as client, daemon.client() as other:
        client.append("gone", 1, 0, tokens=[1, 2])
        client.append("renewed", 1, 0, tokens=[3, 4])
        with daemon.stopped():
            assert client.park("gone", 1, wait=False).detail == "parking"
            assert client.park("renewed", 1, wait=False).detail == "parking"
            releasing = in_thread(lambda: other.release("gone", 1))
            wait_until(lambda: _in_flight(daemon, "gone") == 2, "the release waiting for the save")
        result(*releasing)
        fresh = client.append("renewed", 2, 0, tokens=[7])  # the new epoch ends the old one once its save is done
        assert fresh.admitted and np.array_equal(fresh.rows, rows_of(client, [7]))
        stats = checked(client)
        assert [(row.session_id, row.epoch, row.tier) for row in stats.sessions] == [("renewed", 2, "hot")]
        assert stats.budget.spill_bytes == 0 and stats.counters["parks"] == 2
        assert refused(lambda: client.append("renewed", 1, 2, tokens=[5])).code == "stale_epoch"


def test_a_save_that_fails_behind_the_reply_ends_the_session_and_its_next_append_misses(serve, fake_model):
    kinds = fake_kinds()
    daemon = serve(fake_model, "--max-sessions", "2", kinds=kinds)
    with daemon.client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3])
        kinds[0].behaviour.fail = lambda command: Failed(code="internal", message="no memory for the state") if isinstance(command, SaveState) else None
        assert client.park("s", 1, wait=False).detail == "parking"  # answered before the worker refused
        wait_until(lambda: _row(client, "s") is None, "the session ended by its failed save")
        kinds[0].behaviour.fail = None
        missed = refused(lambda: client.append("s", 1, 3, tokens=[4]))
        assert (missed.code, missed.reason) == ("cache_miss", "evicted")
        stats = checked(client)
        assert stats.counters.get("parks", 0) == 0 and stats.budget.reserved_bytes == 0


@contextlib.contextmanager
def _route_of(serve, fake_shards):
    daemons = [serve(path, "--max-sessions", "2", name=f"stage{index}") for index, path in enumerate(fake_shards)]
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(daemon.client()) for daemon in daemons]
        yield daemons, clients, Route(clients)


def test_a_route_parks_without_wait_in_one_round_of_requests_and_a_failing_stage_is_raised_after_all(serve, fake_shards):
    with _route_of(serve, fake_shards) as (daemons, clients, route):
        route.append("s", 1, 0, [1, 2, 3])
        with contextlib.ExitStack() as stack:
            for daemon in daemons:
                stack.enter_context(daemon.stopped())
            # every worker stopped: no daemon can have saved, yet every one answered (in the caller's one thread)
            assert [reply.detail for reply in route.park("s", 1, wait=False)] == ["parking"] * 3
        assert [reply.detail for reply in route.park("s", 1)] == ["already parked"] * 3
        assert np.array_equal(route.append("s", 1, 3, [4]), route.append("t", 1, 0, [1, 2, 3, 4])[-1:])
        clients[1].release("s", 1)  # the middle daemon no longer holds the session: its stage fails, the others park
        with pytest.raises(StageFailed) as failed:
            route.park("s", 1, wait=False)
        assert failed.value.stage == 1 and failed.value.reply.code == "cache_miss"
        wait_until(lambda: [[row.tier for row in client.stats().sessions if row.session_id == "s"] for client in clients] == [["ram"], [], ["ram"]],
                   "the first and last daemons' saves")


def test_ask_all_gives_each_call_its_own_result_or_error_and_a_gone_daemon_costs_only_its_entry(serve, fake_shards):
    with _route_of(serve, fake_shards) as (daemons, clients, route):
        route.append("s", 1, 0, [1, 2])
        outcomes = Client.ask_all([(clients[0], park_call("s", 1)), (clients[1], park_call("nobody", 1)), (clients[2], release_call("s", 1))])
        assert outcomes[0].detail == "parked" and outcomes[2].detail == "released"
        assert isinstance(outcomes[1], KvpoolError) and outcomes[1].reply.code == "cache_miss"
        daemons[2].stop()
        outcomes = Client.ask_all([(client, park_call("s", 1)) for client in clients])
        assert [outcome.detail for outcome in outcomes[:2]] == ["already parked", "parked"]
        assert isinstance(outcomes[2], ConnectionLost)  # its daemon gone: that entry alone
        with pytest.raises(ValueError):
            Client.ask_all([(clients[0], park_call("s", 1)), (clients[0], park_call("s", 1))])


@pytest.fixture
def saves_sent(monkeypatch):
    """SaveState.behind of every save the supervisor asks a worker process for, in order."""
    sent = []
    expect = WorkerHandle._expect

    async def recording(handle, command, expected):
        if isinstance(command, SaveState):
            sent.append(command.behind)
        return await expect(handle, command, expected)

    monkeypatch.setattr(WorkerHandle, "_expect", recording)
    return sent


@pytest.mark.parametrize("mode", MODES)
def test_only_the_save_behind_an_answer_asks_its_worker_for_a_lower_priority(serve, fake_model, mode, saves_sent):
    """A single worker saves a park answered "parking" at a lower CPU priority (SaveState.behind: workers.server.
    background), a waiting park's as before; a batched worker never (the other sequences' batches wait for its saves)."""
    daemon = serve(fake_model, "--max-sessions", "2", *MODES[mode])
    with daemon.client() as client:
        client.append("behind", 1, 0, tokens=[1, 2])
        client.append("waiting", 1, 0, tokens=[3, 4])
        assert client.park("behind", 1, wait=False).detail == "parking"
        assert client.park("behind", 1).detail == "already parked"  # once the save behind is done
        assert client.park("waiting", 1).detail == "parked"
    assert saves_sent == ([True, False] if mode == "process" else [False, False])


def test_the_saves_of_park_after_and_of_a_copy_written_behind_ask_for_a_lower_priority_too(serve, fake_model, tmp_path, saves_sent):
    """--persist-after's copy and --park-after's park: saves nobody waits for, as a park answered before its save
    (a daemon each: housekeeping parks before it copies, so one daemon late to its pass would park first)."""
    copying = serve(fake_model, "--spill-dir", str(tmp_path / "spill"), "--spill-disk-budget", "16MiB", "--persist-after", "0.05", name="copying")
    with copying.client() as client:
        client.append("idle", 1, 0, tokens=[1, 2, 3])
        wait_until(lambda: client.stats().counters.get("persisted", 0) >= 1, "the copy written behind")
        assert _row(client, "idle").tier == "hot"
    assert saves_sent == [True]
    parking = serve(fake_model, "--park-after", "0.05", name="parking")
    with parking.client() as client:
        client.append("idle", 1, 0, tokens=[1, 2, 3])
        wait_until(lambda: _row(client, "idle").tier != "hot", "the park for --park-after")
        assert checked(client).counters["parks"] == 1
    assert saves_sent == [True, True]

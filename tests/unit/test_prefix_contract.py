"""Shared prefixes (README, "Shared prefixes") on fake workers, in both modes: the protocol (lookup, admission
from a stored prefix, its misses and bad input), what fills the store (a prefill completing blocks, a park, a
release), one entry per prefix, scopes apart, eviction, and the router starting new sessions and replays from
the longest prefix the whole route holds. The rows each session gets are its own history's
(tests/support/fake_worker.expected_rows): a reused prefix must hold exactly its tokens' state. Exactness on
llama.cpp's numbers is tests/daemon/test_prefix.py's."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvpool.cli.status import render
from kvpool.router.prefix import route_block
from kvpool.router.router import Router
from kvpool.wire.prefix import DIGEST_BYTES, chain_digests
from tests.support.contract import MODES, mode_flags, rows_of
from tests.support.daemons import HANG_GUARD_S, in_thread, refused, result, wait_until
from tests.support.fake_worker import expected_rows, fake_kinds
from workers.server.commands import SaveState

BLOCK = 4
FLAGS = ("--prefix-block", str(BLOCK))


def prompt(seed: int, length: int) -> list[int]:
    return [int(token) for token in np.random.default_rng(seed).integers(1, 200, length)]


def route_rows(clients, history: list[int]) -> np.ndarray:
    """The last row a route of fake daemons returns for a fresh session appending `history`."""
    rows = np.asarray(history, np.int32)
    for client in clients:
        rows = expected_rows(client.hello.shard.shape, rows, output_rows="all")
    return rows[-1]


def restoring_threads() -> list[threading.Thread]:
    """The router's restores ahead still running (kvpool.router.prefix.RestoringAhead)."""
    return [thread for thread in threading.enumerate() if thread.name == "kvpool-restore-ahead"]


def save_holder():
    """(saving, release, hook): a fake worker's `fail` hook that holds each SaveState (a capture's save) in the worker
    until `release` is set, setting `saving` as one arrives."""
    saving, release = threading.Event(), threading.Event()

    def hold_saves(command):
        if isinstance(command, SaveState):
            saving.set()
            assert release.wait(HANG_GUARD_S), "hang guard: the test never let the save go"
        return None

    return saving, release, hold_saves


def held(client, tokens: list[int], scope: str = "") -> int:
    return client.lookup_prefix(scope, chain_digests(tokens, BLOCK, scope))


def stored(client, tokens: list[int], scope: str = "") -> None:
    """Wait until the daemon's store holds every whole block of `tokens` (a prefill's capture runs after its reply)."""
    wait_until(lambda: held(client, tokens, scope) == len(tokens) // BLOCK, what=f"{len(tokens) // BLOCK} blocks stored")


@pytest.mark.parametrize("mode", MODES)
def test_a_prefill_fills_the_store_and_a_new_session_admitted_from_it_continues_its_own_history(serve, fake_model, mode):
    daemon = serve(fake_model, *mode_flags(mode), *FLAGS)
    with daemon.client() as client:
        assert client.hello.prefix_block == BLOCK and client.hello.max_prefix_digests == client.hello.max_n_ctx // BLOCK
        system = prompt(1, 3 * BLOCK)
        first = system + [7, 8]
        digests = chain_digests(first, BLOCK)
        assert client.lookup_prefix("", digests) == 0
        client.append("a", 1, 0, tokens=first, block_digests=digests)
        stored(client, first)
        assert client.admit_prefix("b", 1, "", digests[:2]) == 2 * BLOCK  # a shorter length of the same entry
        step = client.append("b", 1, 2 * BLOCK, tokens=system[2 * BLOCK :] + [9])
        assert step.restored and np.array_equal(step.rows, rows_of(client, system + [9]))
        stats = client.stats()
        assert (stats.prefixes.entries, stats.prefixes.blocks, stats.prefixes.hits, stats.prefixes.hit_tokens) == (1, 3, 1, 2 * BLOCK)
        assert (stats.counters["prefix_hits"], stats.counters["prefix_hit_tokens"]) == (1, 2 * BLOCK)
        assert stats.integrity == "ok"
        assert "prefix  1 entries, 3 blocks of 4 tokens" in render(stats) and f"hits 1 ({2 * BLOCK} positions not computed)" in render(stats)
        scraped = generate_latest(daemon.supervisor.service.metrics.registry).decode()
        assert "kvpool_prefix_hits_total 1.0" in scraped and "kvpool_prefix_entries 1.0" in scraped


@pytest.mark.parametrize("mode", MODES)
def test_a_prefill_replies_before_its_save_for_the_store_and_what_follows_its_reply_waits_for_that_save(serve, fake_model, mode):
    """The capture runs after the append's reply (kvpool.daemon.prefix.PrefixRequests.capture_after): held here in
    the worker, the prefill has answered, while a lookup, a prefix admission and the session's next append, all sent
    after that reply, wait for it (a lookup of another scope does not); once it is in, each sees the stored blocks,
    and the session its own history."""
    kinds = fake_kinds()
    daemon = serve(fake_model, *mode_flags(mode), *FLAGS, kinds=kinds)
    saving, release, hold_saves = save_holder()

    with daemon.client() as client, daemon.client() as other, daemon.client() as third, daemon.client() as fourth:
        system = prompt(2, 3 * BLOCK)
        first = system + [7, 8]
        digests = chain_digests(first, BLOCK)
        kinds[0].behaviour.fail = hold_saves
        try:
            reply = client.append("a", 1, 0, tokens=first, block_digests=digests)  # answered with its save held
            assert saving.wait(HANG_GUARD_S) and reply.length == len(first)
            outcome: dict[str, object] = {}
            waiting = [
                threading.Thread(target=lambda: outcome.__setitem__("held", other.lookup_prefix("", digests))),
                threading.Thread(target=lambda: outcome.__setitem__("admitted", third.admit_prefix("b", 1, "", digests[:2]))),
                threading.Thread(target=lambda: outcome.__setitem__("next", client.append("a", 1, len(first), tokens=[9]))),
            ]
            for thread in waiting:
                thread.start()
            for thread in waiting:
                thread.join(0.3)
            assert outcome == {} and all(thread.is_alive() for thread in waiting), outcome
            elsewhere = threading.Thread(target=lambda: outcome.__setitem__("other scope", fourth.lookup_prefix("b", chain_digests(first, BLOCK, "b"))))
            elsewhere.start()
            elsewhere.join(HANG_GUARD_S)  # another scope's lookup waits for no capture of this one
            assert outcome == {"other scope": 0}, outcome
        finally:
            kinds[0].behaviour.fail = None
            release.set()
        for thread in waiting:
            thread.join(HANG_GUARD_S)
        assert outcome["held"] == 3 and outcome["admitted"] == 2 * BLOCK, outcome
        assert np.array_equal(outcome["next"].rows, rows_of(client, first + [9]))
        step = third.append("b", 1, 2 * BLOCK, tokens=system[2 * BLOCK :] + [5])
        assert step.restored and np.array_equal(step.rows, rows_of(client, system + [5]))
        stats = client.stats()
        assert (stats.counters["prefix_stored"], stats.prefixes.entries, stats.integrity) == (1, 1, "ok")


@pytest.mark.parametrize("mode", MODES)
def test_a_new_epoch_that_waits_for_a_prefill_comes_after_its_capture_and_the_prefix_is_stored(serve, fake_model, mode):
    """The append passes the session on to its capture (Gate.pass_on): a request that queued for the session during
    the prefill (here a newer epoch, whose fence drops the old one) gets it only once the prefix is offered."""
    kinds = fake_kinds()
    daemon = serve(fake_model, *mode_flags(mode), *FLAGS, kinds=kinds)
    with daemon.client() as client, daemon.client() as other:
        first = prompt(3, 3 * BLOCK) + [7]
        kinds[0].behaviour.row_delay_s = 0.2  # the 13-row prefill lasts 2.6 s: the newer epoch queues meanwhile
        outcome: dict[str, object] = {}
        prefill = threading.Thread(target=lambda: outcome.__setitem__("reply", client.append("a", 1, 0, tokens=first, block_digests=chain_digests(first, BLOCK))))
        prefill.start()
        wait_until(lambda: any(row.in_flight for row in other.stats().sessions), "the prefill in flight")
        newer = threading.Thread(target=lambda: outcome.__setitem__("newer", other.append("a", 2, 0, tokens=[5])))
        newer.start()
        prefill.join(HANG_GUARD_S)
        newer.join(HANG_GUARD_S)
        kinds[0].behaviour.row_delay_s = 0.0
        assert outcome["reply"].length == len(first) and outcome["newer"].admitted, outcome
        assert held(other, first) == 3  # the old epoch's prefix, offered before its session was dropped
        stats = other.stats()
        assert (stats.counters["prefix_stored"], [(row.session_id, row.epoch) for row in stats.sessions], stats.integrity) == (1, [("a", 2)], "ok")


@pytest.mark.parametrize("mode", MODES)
def test_one_entry_per_prefix_a_longer_offer_covers_a_shorter_and_scopes_never_share(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), *FLAGS).client() as client:
        # Two places: each admission from the third on evicts, and may find both sessions still busy with their
        # captures (run after the reply): it waits for them, asking no admit_timeout_s (the next test holds them).
        base = prompt(2, 2 * BLOCK)
        for index in range(3):  # three sessions of the same two blocks: one entry
            tokens = base + [index + 1]
            client.append(f"s{index}", 1, 0, tokens=tokens, block_digests=chain_digests(tokens, BLOCK))
        stored(client, base)
        assert client.stats().prefixes.entries == 1
        longer = base + prompt(3, BLOCK) + [5]
        client.append("long", 1, 0, tokens=longer, block_digests=chain_digests(longer, BLOCK))
        stored(client, longer)
        prefixes = client.stats().prefixes
        assert (prefixes.entries, prefixes.blocks) == (1, 3)  # one prefix held: the third block stored as the two-block entry's child
        assert held(client, base, scope="tenant-b") == 0  # another scope learns nothing
        other = base + [1]
        client.append("b0", 1, 0, tokens=other, block_digests=chain_digests(other, BLOCK, "tenant-b"), prefix_scope="tenant-b")
        stored(client, base, scope="tenant-b")
        assert client.stats().prefixes.entries == 2
        missed = refused(lambda: client.admit_prefix("x", 1, "tenant-c", chain_digests(base, BLOCK, "tenant-c")))
        assert (missed.code, missed.reason) == ("cache_miss", "prefix_evicted")
        assert client.stats().integrity == "ok"


@pytest.mark.parametrize("mode", MODES)
def test_an_admission_that_finds_its_place_held_by_a_capture_after_the_reply_waits_for_it(serve, fake_model, mode):
    """The daemon's one place holds a session whose prefill has answered while its capture (held here in the worker)
    still holds it (Session.settling): a second admission, asking no admit_timeout_s, waits for it - past its timeout -
    rather than being refused over_budget for the daemon's own work; it then parks the first (the warm tier is on),
    which goes on with its own history, restored."""
    kinds = fake_kinds()
    daemon = serve(fake_model, *mode_flags(mode), "--seqs-per-worker", "1", *FLAGS, "--max-sessions", "1", kinds=kinds)
    saving, release, hold_saves = save_holder()

    queue = daemon.supervisor.service.admission.queue
    with daemon.client() as client, daemon.client() as other:
        first, second = prompt(4, 2 * BLOCK) + [4], prompt(5, 2 * BLOCK) + [5]
        kinds[0].behaviour.fail = hold_saves
        try:
            assert client.append("a", 1, 0, tokens=first, block_digests=chain_digests(first, BLOCK)).length == len(first)
            assert saving.wait(HANG_GUARD_S)  # answered, its capture held in the worker
            admitting = in_thread(lambda: other.append("b", 1, 0, tokens=second, block_digests=chain_digests(second, BLOCK)))
            wait_until(lambda: len(queue) == 1 or not admitting[0].is_alive(), "the admission waiting in line (or answered)")
            assert admitting[0].is_alive()
        finally:
            kinds[0].behaviour.fail = None
            release.set()
        reply = result(*admitting)
        assert reply.admitted and np.array_equal(reply.rows, rows_of(client, second))
        assert {row.session_id: row.tier for row in client.stats().sessions} == {"a": "ram", "b": "hot"}
        step = client.append("a", 1, len(first), tokens=[9], admit_timeout_s=HANG_GUARD_S)
        assert step.restored and np.array_equal(step.rows, rows_of(client, first + [9]))
        stats = client.stats()
        assert (stats.counters.get("over_budget_rejects", 0), stats.counters.get("misses", 0), stats.integrity) == (0, 0, "ok"), stats.counters


@pytest.mark.parametrize("mode", MODES)
def test_bad_prefix_requests_are_refused_alone_and_touch_nothing(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), *FLAGS, "--n-ctx", "64").client() as client:
        tokens = prompt(4, 2 * BLOCK + 1)
        digests = chain_digests(tokens, BLOCK)
        client.append("a", 1, 0, tokens=tokens, block_digests=digests)
        stored(client, tokens)
        before = client.stats()
        too_many = [bytes(DIGEST_BYTES)] * (64 // BLOCK + 1)
        assert refused(lambda: client.lookup_prefix("", too_many)).code == "bad_request"
        assert refused(lambda: client.lookup_prefix("", [b"short"])).code == "bad_request"
        assert refused(lambda: client.lookup_prefix("x" * 300, digests)).code == "bad_request"
        assert refused(lambda: client.admit_prefix("b", 1, "", [])).code == "bad_request"
        assert refused(lambda: client.admit_prefix("b", 1, "", digests, n_ctx=BLOCK)).code == "bad_request"  # beyond its n_ctx
        assert refused(lambda: client.admit_prefix("b", 1, "", digests, n_ctx=128)).code == "bad_request"  # beyond --n-ctx
        assert refused(lambda: client.admit_prefix("a", 1, "", digests)).code == "bad_request"  # holds state already
        assert refused(lambda: client.admit_prefix("a", 0, "", digests)).code == "stale_epoch"
        bad_append = refused(lambda: client.append("a", 1, len(tokens), tokens=[1], block_digests=[b"x"]))
        assert (bad_append.code, bad_append.length) == ("bad_request", len(tokens))
        after = client.stats()
        assert [(row.session_id, row.length) for row in after.sessions] == [(row.session_id, row.length) for row in before.sessions]
        assert (after.prefixes.entries, after.prefixes.hits) == (before.prefixes.entries, 0) and after.integrity == "ok"


@pytest.mark.parametrize("mode", MODES)
def test_entries_are_evicted_least_recently_used_and_an_admission_of_an_evicted_prefix_misses(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), *FLAGS, "--prefix-cache-budget", "6KiB").client() as client:
        prompts = [prompt(10 + index, 2 * BLOCK + 1) for index in range(8)]
        for index, tokens in enumerate(prompts):
            client.append(f"p{index}", 1, 0, tokens=tokens, block_digests=chain_digests(tokens, BLOCK))
            stored(client, tokens)
            client.release(f"p{index}", 1)
        prefixes = client.stats().prefixes
        assert prefixes.evictions > 0 and prefixes.bytes <= prefixes.limit_bytes
        assert held(client, prompts[0]) == 0 and held(client, prompts[-1]) == 2
        missed = refused(lambda: client.admit_prefix("late", 1, "", chain_digests(prompts[0], BLOCK)))
        assert (missed.code, missed.reason) == ("cache_miss", "prefix_evicted")
        assert client.stats().counters["misses_prefix_evicted"] == 1 and client.stats().integrity == "ok"


@pytest.mark.parametrize("mode", MODES)
def test_a_park_and_a_release_offer_blocks_completed_one_row_at_a_time(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), *FLAGS, "--no-direct").client() as client:
        tokens = prompt(5, BLOCK - 1)
        client.append("a", 1, 0, tokens=tokens)
        for position in range(BLOCK - 1, 2 * BLOCK + 1):  # decode steps complete blocks 0 and 1 (no capture: one row each)
            tokens.append(position % 50 + 1)
            client.append("a", 1, position, tokens=tokens[-1:], block_digests=chain_digests(tokens, BLOCK)[position // BLOCK : (position + 1) // BLOCK])
        assert held(client, tokens) == 0
        client.park("a", 1)
        assert held(client, tokens) == 2
        other = prompt(6, 2 * BLOCK)
        client.append("b", 1, 0, tokens=other[:1])
        for position in range(1, len(other)):
            client.append("b", 1, position, tokens=other[position : position + 1], block_digests=chain_digests(other, BLOCK)[position // BLOCK : (position + 1) // BLOCK])
        assert held(client, other) == 0
        client.release("b", 1)
        assert held(client, other) == 2
        assert client.stats().integrity == "ok"


@pytest.mark.parametrize("mode", MODES)
def test_a_truncate_forgets_the_blocks_the_session_no_longer_holds_whole(serve, fake_model, mode):
    with serve(fake_model, *mode_flags(mode), *FLAGS, "--no-direct").client() as client:
        tokens = prompt(7, 3 * BLOCK)
        client.append("a", 1, 0, tokens=tokens[:1])
        client.append("a", 1, 1, tokens=tokens[1:2 * BLOCK + 1], block_digests=chain_digests(tokens, BLOCK)[:2])
        stored(client, tokens[: 2 * BLOCK])
        client.truncate("a", 1, BLOCK + 1)
        changed = tokens[: BLOCK + 1] + [3] * (2 * BLOCK - 1)
        client.append("a", 1, BLOCK + 1, tokens=changed[BLOCK + 1 :], block_digests=chain_digests(changed, BLOCK)[1:])
        stored(client, changed)
        assert client.admit_prefix("b", 1, "", chain_digests(changed, BLOCK)) == 3 * BLOCK
        step = client.append("b", 1, 3 * BLOCK, tokens=[1])
        assert np.array_equal(step.rows, rows_of(client, changed + [1]))


@pytest.mark.parametrize("mode", MODES)
def test_the_router_starts_new_sessions_from_the_longest_prefix_the_whole_route_holds(serve, fake_shards, mode):
    daemons = [serve(path, *mode_flags(mode), *FLAGS, name=f"chain{index}") for index, path in enumerate(fake_shards)]
    clients = [daemon.client() for daemon in daemons]
    try:
        router = Router(clients)
        system = prompt(8, 3 * BLOCK + 2)
        first = router.session("first")
        assert np.array_equal(first.append(system + [1, 2])[-1], route_rows(clients, system + [1, 2]))
        assert router.counts.prefix_hits == 0
        for client in clients:
            stored(client, system[: 3 * BLOCK])
        second = router.session("second")
        assert np.array_equal(second.append(system + [3])[-1], route_rows(clients, system + [3]))
        assert (router.counts.prefix_hits, router.counts.prefix_hit_tokens) == (1, 3 * BLOCK)
        assert second.partition == (3 * BLOCK, 3)
        counters = [client.stats().counters for client in clients]
        assert [one["prefix_hit_tokens"] for one in counters] == [3 * BLOCK] * 3
        # the first daemon restored it with its rows, the later ones ahead of theirs (RestoringAhead), answered
        # before the append returned
        assert [one.get("restore_requests", 0) for one in counters] == [0, 1, 1] and counters[0]["restores"] == 1
        assert not restoring_threads()
        step = second.append([4])
        assert np.array_equal(step[-1], route_rows(clients, system + [3, 4]))
        clients[1].release("second", second.epoch)  # the middle daemon loses it: the next append replays
        step = second.append([5])
        assert np.array_equal(step[-1], route_rows(clients, system + [3, 4, 5]))
        # the replay's release offered each daemon's state of the session (its 4 blocks) before the new epoch: it
        # starts from all of them and sends nothing again
        assert (router.counts.replays, router.counts.prefix_hits, router.counts.prefix_hit_tokens) == (1, 2, 3 * BLOCK + 4 * BLOCK)
        assert router.counts.replayed_tokens == 0
        first.release()
        second.release()
        off = Router(clients, prefix_cache=False).session("off")
        assert np.array_equal(off.append(system + [3])[-1], route_rows(clients, system + [3]))
        assert off.partition == (len(system) + 1,)
        off.release()
        scoped = router.session("scoped", prefix_scope="tenant")
        scoped.append(system + [3])
        assert router.counts.prefix_hits == 2  # another scope: computed in full
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_prefix_one_daemon_cannot_admit_is_computed_and_what_the_others_admitted_is_released(serve, fake_shards, mode):
    """Every daemon's lookup holds the prefix, but the last cannot admit it (its spill store, where an admitted
    session waits parked, holds 1 byte): the router releases what the others admitted, restores nothing and
    computes the whole prompt (prefix_fallbacks); the session's rows are its own history's."""
    daemons = [serve(path, *mode_flags(mode), *FLAGS, *(("--spill-budget", "1") if index == 2 else ()), name=f"fallback{index}")
               for index, path in enumerate(fake_shards)]
    clients = [daemon.client() for daemon in daemons]
    try:
        router = Router(clients)
        system = prompt(9, 3 * BLOCK + 2)
        router.session("first").append(system + [1, 2])
        for client in clients:
            stored(client, system[: 3 * BLOCK])
        second = router.session("second")
        assert np.array_equal(second.append(system + [3])[-1], route_rows(clients, system + [3]))
        assert (router.counts.prefix_hits, router.counts.prefix_fallbacks) == (0, 1)
        assert second.partition == (len(system) + 1,)
        counters = [client.stats().counters for client in clients]
        assert [one.get("prefix_hits", 0) for one in counters] == [1, 1, 0]  # admitted on the first two, then released
        assert [one.get("restore_requests", 0) for one in counters] == [0] * 3 and not restoring_threads()
        assert np.array_equal(second.append([4])[-1], route_rows(clients, system + [3, 4]))
        second.release()
        assert not any(row.session_id == "second" for client in clients for row in client.stats().sessions)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("mode", MODES)
def test_every_append_of_a_routed_session_names_its_own_blocks_from_position_zero(serve, fake_shards, mode):
    """The digests an append carries chain from the session's first token, whatever its position: a state is
    never filed under another prompt's digests (here a truncated session's later tokens), and blocks completed
    one decode step at a time reach the store where those appends reach the daemon (batched mode, --no-direct)."""
    daemons = [serve(path, *mode_flags(mode), *FLAGS, "--no-direct", name=f"own{index}") for index, path in enumerate(fake_shards)]
    clients = [daemon.client() for daemon in daemons]
    try:
        router = Router(clients)
        x = prompt(20, 30)
        writer = router.session("x")
        writer.append(x)
        writer.truncate(5)
        writer.append(x[5:29])  # positions [5, 29): blocks 1..6 end inside it
        y = x[5:21] + x[:4]  # begins with the writer's later tokens: no stored state holds them at positions [0, 16)
        assert [client.lookup_prefix("", chain_digests(y, BLOCK)) for client in clients] == [0, 0, 0]
        reader = router.session("y")
        assert np.array_equal(reader.append(y)[-1], route_rows(clients, y)) and router.counts.prefix_hits == 0
        decoder = router.session("decoder")
        tokens = prompt(21, 2 * BLOCK + 1)
        decoder.append(tokens)
        for step in range(2 * BLOCK):  # blocks 2..4 completed one row at a time
            tokens.append(step + 1)
            decoder.append(tokens[-1:])
        decoder.release()
        assert [held(client, tokens) for client in clients] == [len(tokens) // BLOCK] * 3
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("replaced_by", ["stop", "drain"])
def test_a_router_follows_a_daemon_replaced_on_its_socket_by_one_of_another_block(serve, fake_model, replaced_by):
    """A daemon of block 4 stops (at once, or drained) and one of block 32 (the same --n-ctx: 2 digests at most)
    serves the socket: the client takes the new daemon's Hello as it reconnects, and the router's digests follow
    it. A prompt of 10 old blocks is computed and its block stored under the new block's digests, and a session
    from before the swap goes on with rows of its own history."""
    old = serve(fake_model, "--prefix-block", "4", "--n-ctx", "64", name="replaced")
    client = old.client()
    try:
        router = Router([client])
        earlier = router.session("earlier")
        before = prompt(30, 10)
        earlier.append(before)
        stored(client, before)  # block 4's digests, offered after the reply: not cut short by the stop
        old.stop() if replaced_by == "stop" else old.drain()
        serve(fake_model, "--prefix-block", "32", "--n-ctx", "64", name="replaced")
        tokens = prompt(31, 40)
        assert np.array_equal(router.session("s").append(tokens)[-1], route_rows([client], tokens))
        assert client.hello.prefix_block == 32 and client.hello.max_prefix_digests == 2
        assert route_block(router.route) == 32
        wait_until(lambda: client.lookup_prefix("", chain_digests(tokens, 32)) == 1, what="the new block stored")
        assert np.array_equal(earlier.append([7])[-1], route_rows([client], before + [7]))
    finally:
        client.close()

"""Shared prefixes on the real model through a route of three daemons, in both modes (README, "Shared
prefixes"): a new session whose prompt begins with what an earlier session computed starts from the prefix
every daemon stored and computes only the rest, and its logits are bit for bit the whole model's computing the
same tokens in the same chunks (the prefix as it was computed, then the rest); the prefix store outlives a
restart with --spill-dir. The protocol's edges are tests/unit/test_prefix_contract.py's."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.router.router import Router
from kvpool.wire.prefix import chain_digests
from tests.support.chains import daemon_chain, greedy_with_logits, release_all, start_chain, stop_all
from tests.support.contract import MODES, mode_flags
from tests.support.daemons import wait_until

pytestmark = pytest.mark.timeout(1800)
N_CTX = 512
BLOCK = 32
GREEDY = 6
OPTIONS = ("--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "2", "--prefix-block", str(BLOCK))


def prompts(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """A system prompt of more than two blocks, and two messages after it."""
    system = tokenizer.encode("You are a careful assistant. Answer in one short sentence, politely, and never make things up. " * 4)
    assert len(system) > 2 * BLOCK
    return system, tokenizer.encode(" Question: what is the capital of France?"), tokenizer.encode(" Question: name a large planet of our solar system.")


def stored_everywhere(clients, tokens: list[int]) -> None:
    """Every daemon's store holds the whole blocks of `tokens` (a prefill's capture runs after its reply)."""
    digests = chain_digests(tokens, BLOCK)
    wait_until(lambda: all(client.lookup_prefix("", digests) == len(digests) for client in clients), what=f"{len(digests)} blocks stored on every daemon")


def whole_model_reference(whole_model, first: list[int], reused: int, second: list[int]):
    """The whole model computing `first` in one chunk, cut to `reused` positions, then `second`'s rest in one
    chunk and greedy steps: the tokens and the logits each was chosen from."""
    with whole_model.new_context(N_CTX) as context:
        context.append(0, tokens=np.asarray(first))
        context.truncate(reused)
        return greedy_with_logits(
            lambda start, tokens: context.append(start + reused, tokens=np.asarray(tokens)), second[reused:], GREEDY,
        )


@pytest.fixture(scope="module", params=MODES)
def route(request, shards, socket_dir):
    with daemon_chain([shard.path for shard in shards], socket_dir, f"prefix-{request.param}", *OPTIONS, *mode_flags(request.param)) as daemons:
        yield daemons


def test_a_new_session_starts_from_the_prefix_the_route_stored_and_equals_the_whole_model_in_those_chunks(route, whole_model, tokenizer):
    system, question, other = prompts(tokenizer)
    clients = [daemon.client() for daemon in route]
    try:
        router = Router(clients)
        first = router.session("first")
        first.append(system + question)
        stored_everywhere(clients, system)
        second = router.session("second")
        tokens, logits = greedy_with_logits(lambda start, rows: second.append_at(start, rows), system + other, GREEDY)
        reused = (len(system) // BLOCK) * BLOCK
        assert (router.counts.prefix_hits, router.counts.prefix_hit_tokens) == (1, reused)
        assert second.partition[:2] == (reused, len(system) + len(other) - reused)
        expected_tokens, expected_logits = whole_model_reference(whole_model, system + question, reused, system + other)
        assert tokens == expected_tokens
        assert np.abs(logits - expected_logits).max() == 0.0
        for client in clients:
            counters = client.stats().counters
            assert (counters["prefix_hits"], counters["prefix_hit_tokens"]) == (1, reused)  # the module's first test
    finally:
        for client in clients:
            client.close()
        release_all(route)


def test_four_sessions_of_one_system_prompt_store_it_once_and_each_continues_exactly(route, whole_model, tokenizer):
    system, question, _other = prompts(tokenizer)
    clients = [daemon.client() for daemon in route]
    try:
        router = Router(clients)
        router.session("seed").append(system + question)  # a hit too when an earlier test of the module stored it
        stored_everywhere(clients, system)
        reused = (len(system) // BLOCK) * BLOCK
        seeded = router.counts.prefix_hits
        before = [client.stats().prefixes for client in clients]
        for index in range(4):
            message = tokenizer.encode(f" Question number {index + 1}: say a colour.")
            session = router.session(f"s{index}")
            got = greedy_with_logits(lambda start, rows, session=session: session.append_at(start, rows), system + message, 3)
            expected = whole_model_reference(whole_model, system + question, reused, system + message)
            assert got[0] == expected[0][:3] and np.abs(got[1] - expected[1][:3]).max() == 0.0
            session.release()
        assert router.counts.prefix_hits == seeded + 4
        for client, earlier in zip(clients, before):
            prefixes = client.stats().prefixes
            assert (prefixes.hits - earlier.hits, prefixes.hit_tokens - earlier.hit_tokens) == (4, 4 * reused)
            assert client.lookup_prefix("", chain_digests(system, BLOCK)) == len(system) // BLOCK
    finally:
        for client in clients:
            client.close()
        release_all(route)


def test_a_prefill_that_stores_a_prefix_keeps_its_direct_channel_for_the_decode_steps(route, tokenizer):
    """The prefill's state is saved after its reply, and the session's direct channel bound after that save
    (every supervisor command to a worker revokes it): once the blocks are stored, the decode steps skip the
    supervisor, as without a store."""
    text = tokenizer.encode("A different system prompt, one this module stored nowhere before: be brief and kind. " * 3)
    clients = [daemon.client() for daemon in route]
    try:
        before = [client.stats().counters for client in clients]
        session = Router(clients).session("direct")
        session.append(text + [13, 14])
        stored_everywhere(clients, text[: (len(text) // BLOCK) * BLOCK])
        for token in (15, 16, 17):
            session.append([token])
        for client, earlier in zip(clients, before):
            stats = client.stats()
            direct = stats.counters["direct_appends"] - earlier.get("direct_appends", 0)
            through = stats.counters["appends"] - earlier["appends"]
            assert (direct, through) == ((3, 1) if stats.mode == "process" else (0, 4)), stats.mode
            assert stats.counters["prefix_stored"] - earlier.get("prefix_stored", 0) == 1
    finally:
        for client in clients:
            client.close()
        release_all(route)


def test_decode_steps_sent_at_once_after_a_prefill_that_stores_a_prefix_are_exact_and_one_at_most_goes_through_each_daemon(route, whole_model, tokenizer):
    """The prefill's reply names the direct channel before its capture binds it: the decode steps sent right after,
    while the saves may still run, are the whole model's greedy steps bit for bit, and each daemon serves at most one
    of them itself (a step that reaches a worker before the binding is answered channel_revoked and goes through
    the daemon, which waits for the capture); the blocks are stored all the same."""
    text = tokenizer.encode("One more system prompt, stored nowhere before this test: answer in French, briefly. " * 3)
    clients = [daemon.client() for daemon in route]
    try:
        before = [client.stats().counters for client in clients]
        session = Router(clients).session("at-once")
        tokens, logits = greedy_with_logits(lambda start, rows: session.append_at(start, rows), text, 4)
        with whole_model.new_context(N_CTX) as context:
            expected_tokens, expected_logits = greedy_with_logits(lambda start, rows: context.append(start, tokens=np.asarray(rows)), text, 4)
        assert tokens == expected_tokens and np.abs(logits - expected_logits).max() == 0.0
        stored_everywhere(clients, text[: (len(text) // BLOCK) * BLOCK])
        for client, earlier in zip(clients, before):
            stats = client.stats()
            direct = stats.counters["direct_appends"] - earlier.get("direct_appends", 0)
            through = stats.counters["appends"] - earlier["appends"]
            assert direct + through == 1 + len(tokens) and (1 <= through <= 2 if stats.mode == "process" else direct == 0), (stats.mode, direct, through)
            assert stats.counters["prefix_stored"] - earlier.get("prefix_stored", 0) == 1
    finally:
        for client in clients:
            client.close()
        release_all(route)


def test_stored_prefixes_outlive_a_restart_with_a_spill_dir(shards, socket_dir, tmp_path, whole_model, tokenizer):
    system, question, other = prompts(tokenizer)
    spill = [tmp_path / f"spill{index}" for index in range(len(shards))]
    per_daemon = [("--spill-dir", str(directory), "--spill-disk-budget", "64MiB") for directory in spill]
    paths = [shard.path for shard in shards]
    daemons = start_chain(paths, socket_dir, "prefix-durable", *OPTIONS, per_daemon=per_daemon)
    try:
        clients = [daemon.client() for daemon in daemons]
        Router(clients).session("first").append(system + question)
        stored_everywhere(clients, system)
        for client in clients:
            client.close()
        stop_all(daemons)  # SIGTERM: a drain; no stop removes a stored prefix's file
        assert all(len(list((directory / "prefixes").glob("prefix-*.kvprefix"))) == 1 for directory in spill)
        daemons = start_chain(paths, socket_dir, "prefix-durable", *OPTIONS, per_daemon=per_daemon)
        clients = [daemon.client() for daemon in daemons]
        assert all(client.stats().counters["prefix_adopted"] == 1 for client in clients)
        router = Router(clients)
        second = router.session("second")
        tokens, logits = greedy_with_logits(lambda start, rows: second.append_at(start, rows), system + other, GREEDY)
        reused = (len(system) // BLOCK) * BLOCK
        assert router.counts.prefix_hit_tokens == reused
        expected_tokens, expected_logits = whole_model_reference(whole_model, system + question, reused, system + other)
        assert tokens == expected_tokens and np.abs(logits - expected_logits).max() == 0.0
        for client in clients:
            client.close()
    finally:
        stop_all(daemons)

"""Router.replan on real daemons: live sessions move from one route onto another with other split points and
another number of shards (export, re-slice, import under epoch + 1; kvpool.router.move), and continue bit for
bit as an uninterrupted run on the whole model does (same append partition, in process: LocalChain); a session
whose move fails replays on the new route alone, the others move. Waits are hang guards only."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.client.client import Client
from kvpool.local.chain import LocalChain
from kvpool.router.move import MoveFailed
from kvpool.router.router import RecoveryPolicy, Router
from kvpool.shard.cache import cached_shards
from kvpool.shard.ranges import parse_splits
from tests.conftest import EVEN_SPLIT, TOTAL_LAYERS
from tests.support.chains import SteppedGreedy, start_chain, stop_all
from tests.support.daemons import DaemonProcess

pytestmark = pytest.mark.timeout(3600)
N_CTX = 256
CHUNK = 7
OPTIONS = ("--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "3")
SPLITS = {"even": EVEN_SPLIT, "two": "0:14,14:30", "four": "0:4,4:12,12:21,21:30"}
QUICK = RecoveryPolicy(backoff_base_s=0.01, backoff_max_s=0.1)


@pytest.fixture(scope="module")
def routes(model_path, shard_sets, shard_root, socket_dir):
    """Daemons of four routes of the bundled model: the even split (3 shards), two and four shards cut
    elsewhere, and the whole model in one daemon."""
    paths = {"even": [info.path for info in shard_sets[EVEN_SPLIT]], "whole": [model_path]}
    for name in ("two", "four"):
        split = SPLITS[name]
        paths[name] = [info.path for info in cached_shards(model_path, parse_splits(split, TOTAL_LAYERS), root=shard_root / split.replace(",", "_"))]
    started: dict[str, list[DaemonProcess]] = {}
    try:
        for name, shard_paths in paths.items():
            started[name] = start_chain(shard_paths, socket_dir, name, *OPTIONS)
        yield started
    finally:
        stop_all([daemon for daemons in started.values() for daemon in daemons])


@pytest.fixture
def clients(routes):
    clients = {name: [daemon.client() for daemon in daemons] for name, daemons in routes.items()}
    yield clients
    for route in clients.values():
        for client in route:
            for row in client.stats().sessions:
                client.release(row.session_id, row.epoch)
            assert client.stats().sessions == []
            client.close()


@pytest.fixture(scope="module")
def whole_model(model_path):
    with LocalChain([model_path]) as chain:
        yield chain


def Greedy(append, prompt: list[int]) -> SteppedGreedy:
    """A session of this module: its prompt in appends of CHUNK tokens, then one token per step."""
    return SteppedGreedy(append, prompt, CHUNK)


def _reference(whole_model, prompt: list[int], steps: int) -> SteppedGreedy:
    session = whole_model.new_session(N_CTX)
    reference = Greedy(session.append, prompt)
    for _ in range(steps):
        reference.step()
    session.close()
    return reference


def _assert_exact(got: SteppedGreedy, expected: SteppedGreedy) -> None:
    assert got.tokens == expected.tokens
    assert np.abs(np.stack(got.rows) - np.stack(expected.rows)).max() == 0.0


def _held(clients: list[Client], session_id: str) -> list[tuple[int, int] | None]:
    held = []
    for client in clients:
        stats = client.stats()
        assert stats.integrity == "ok", stats.integrity
        row = next((row for row in stats.sessions if row.session_id == session_id), None)
        held.append(None if row is None else (row.epoch, row.length))
    return held


def _prompts(prompt_ids, prefix: str) -> dict[str, list[int]]:
    """Three sessions' prompts; each test's own ids (a daemon refuses an epoch older than one it has seen)."""
    return {f"{prefix}a": prompt_ids[0], f"{prefix}b": prompt_ids[1], f"{prefix}c": prompt_ids[1][:9] + prompt_ids[0][-6:]}


def _started(router: Router, prompts: dict[str, list[int]]):
    routed = {name: router.session(name, n_ctx=N_CTX) for name in prompts}
    runs = {name: Greedy(routed[name].append_at, prompt) for name, prompt in prompts.items()}
    return routed, runs


def test_three_replans_across_split_points_and_shard_counts_move_every_session_and_continue_exactly(clients, whole_model, prompt_ids):
    """even (3 shards) -> two -> four -> the whole model -> even: every live session moves at every re-plan
    (no replay), its old epoch is released on the old route, the new route holds it at epoch + 1 and its
    length, and every logit of every step equals the whole model's, bit for bit."""
    plan = ["two", "four", "whole", "even"]
    router = Router(clients["even"], policy=QUICK)
    prompts = _prompts(prompt_ids, "r")
    routed, runs = _started(router, prompts)
    before = clients["even"]
    moved_bytes = 0
    for target in plan:
        for run in runs.values():
            run.step()
        replanned = router.replan(clients[target])
        assert sorted(replanned.moved) == sorted(prompts) and not replanned.failed and not replanned.replays
        moved_bytes += replanned.moved_bytes
        for name, session in routed.items():
            assert replanned.moved[name].length == runs[name].length == session.length
            assert _held(clients[target], name) == [(session.epoch, session.length)] * len(clients[target])
            if target != "even":
                assert _held(before, name) == [None] * len(before), "the old epoch is released on the old route"
        before = clients[target]
    for run in runs.values():
        run.step()
        run.step()
    for name, prompt in prompts.items():
        _assert_exact(runs[name], _reference(whole_model, prompt, len(plan) + 2))
        assert routed[name].epoch == 1 + len(plan)
    counts = router.counts
    assert (counts.moves, counts.move_failures, counts.replays, counts.tail_replays, counts.cache_misses) == (3 * len(plan), 0, 0, 0, 0)
    assert counts.moved_bytes == moved_bytes > 0


def test_a_session_whose_move_fails_replays_on_the_new_route_alone_and_the_others_move(clients, whole_model, prompt_ids):
    """A daemon of the new route already holds session b at the epoch its move takes (put there behind the
    router's back): b's import is refused, b is released on both routes and replays from 0 on the new route
    at its next append; a and c move. All three continue exactly."""
    router = Router(clients["even"], policy=QUICK)
    prompts = _prompts(prompt_ids, "f")
    routed, runs = _started(router, prompts)
    for run in runs.values():
        run.step()
    squatted = clients["two"][1]
    squatted.append("fb", routed["fb"].epoch + 1, 0, hidden=np.zeros((1, squatted.shard.shape.n_embd), dtype=np.float32))
    replanned = router.replan(clients["two"])
    assert sorted(replanned.moved) == ["fa", "fc"] and list(replanned.failed) == ["fb"]
    failure = replanned.failed["fb"]
    assert isinstance(failure, MoveFailed) and failure.step == "import", failure
    assert _held(clients["even"], "fb") == [None] * 3
    assert _held(clients["two"], "fb") == [None, (routed["fb"].epoch, 1)], "the squatter is left; the daemon that took fb's import released it"
    for run in runs.values():
        run.step()
        run.step()
    for name, prompt in prompts.items():
        _assert_exact(runs[name], _reference(whole_model, prompt, 3))
    counts = router.counts
    assert (counts.moves, counts.move_failures, counts.replays) == (2, 1, 1)
    assert routed["fb"].counts.replayed_tokens == runs["fb"].length - 2  # everything it held when the move failed
    assert _held(clients["two"], "fb") == [(routed["fb"].epoch, routed["fb"].length)] * 2


def test_a_route_with_another_kv_layout_is_refused_before_any_import_and_the_session_replays(clients, prompt_ids, socket_dir, model_path):
    """States cannot move between daemons that store V differently (flash attention on the new route): the
    move fails at its layout check, before a byte is imported, and the session replays there, continuing as
    a flash-attention run of the whole model does."""
    flash = DaemonProcess(model_path, socket_dir / "flash.sock", *OPTIONS, "--flash-attn")
    target = [flash.client()]
    try:
        router = Router(clients["even"], policy=QUICK)
        session = router.session("la", n_ctx=N_CTX)
        run = Greedy(session.append_at, prompt_ids[0])
        run.step()
        replanned = router.replan(target)
        assert replanned.failed["la"].step == "layout", replanned.failed["la"]
        assert _held(target, "la") == [None] and _held(clients["even"], "la") == [None] * 3
        run.step()
        assert _held(target, "la") == [(session.epoch, session.length)]
        assert (router.counts.moves, router.counts.move_failures, router.counts.replays) == (0, 1, 1)
        with LocalChain([model_path], flash_attn=True) as flash_model:
            expected = _reference(flash_model, prompt_ids[0], 2)
        assert run.tokens == expected.tokens
        np.testing.assert_array_equal(run.rows[-1], expected.rows[-1])  # the step after the replay, on the new route
        target[0].release("la", session.epoch)
    finally:
        target[0].close()
        flash.stop()

"""Section 2 (kvpool.bench.one_session.measure_route) on fake variants (pure bench logic; the real route:
tests/drills/test_bench.py): the variants take turns every `chunk_steps` timed steps, each on its own greedy
session that goes on where its last turn stopped; each turn's first step is kept apart (cold)."""

from __future__ import annotations

import dataclasses
import pathlib
import types

import numpy as np

from kvpool.bench import one_session
from kvpool.bench.options import BenchOptions
from kvpool.bench.rig import Variant

NAMES = ["llama.cpp whole", "in-process chain", "daemon chain", "daemon chain, sampled on the last", "daemon whole"]
VOCAB = 8


def fake_variants(calls: list[tuple[str, int]]):
    def variant(name: str) -> Variant:
        def append(start: int, tokens) -> np.ndarray:
            calls.append((name, start))
            logits = np.zeros((1, VOCAB), np.float32)
            logits[0, (start + len(tokens)) % VOCAB] = 1.0  # the next token depends on the position only: all agree
            return logits

        return Variant(lambda: calls.append((name, -1)), append)

    return {name: variant(name) for name in NAMES}, lambda: calls.append(("closed", 0))


def test_the_variants_take_turns_every_chunk_steps_and_each_turn_s_first_step_is_kept_apart(monkeypatch, tmp_path):
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(one_session, "route_variants", lambda rig, chains, whole: fake_variants(calls))
    options = dataclasses.replace(BenchOptions(out_dir=tmp_path, model=pathlib.Path("m.gguf")), rounds=2, decode_steps=7, chunk_steps=3)
    rig = types.SimpleNamespace(options=options, prompts=[[1, 2, 3, 4]], shards=[], mid_hidden=np.zeros((1, 4), np.float32), threads=1)
    results = one_session.measure_route(rig, [], None)
    turns = -(-7 // 3)  # 3 + 3 + 1 timed steps: three turns a round, each one cold step more
    assert {name: len(values) for name, values in results["decode_s"].items()} == dict.fromkeys(NAMES, 2 * 7)
    assert {name: len(values) for name, values in results["cold_decode_s"].items()} == dict.fromkeys(NAMES, 2 * turns)
    assert results["chunk_steps"] == 3 and all(results["tokens_identical"].values()) and calls[-1] == ("closed", 0)
    timed = [(name, start) for name, start in calls if start >= 4]  # after the warm-up's and each round's prompt
    warm = 7 * len(NAMES)  # the warm-up: min(steps, 16) steps each, one variant after another
    rounds = [timed[warm:][: (7 + turns) * len(NAMES)], timed[warm + (7 + turns) * len(NAMES):]]
    for index, round_calls in enumerate(rounds):
        order = NAMES if index % 2 == 0 else NAMES[::-1]  # run_interleaved: forwards, then backwards
        expected = [(name, 4 + at) for first, size in ((0, 4), (4, 4), (8, 2)) for name in order for at in range(first, first + size)]
        assert round_calls == expected, index

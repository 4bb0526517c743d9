"""The bench's code-free relay (kvpool.bench.relay) on the bundled model's even split: the bits the same shards give in
this process - the middle shard's hidden rows, the route's greedy tokens - so the bench's ratios against it compare one
computation; a reset starts it again from position 0, and its processes end with close()."""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from kvpool.bench.relay import Relay, RelayFailed
from workers.runtime.model import ShardModel

N_CTX = 256
STEPS = 8


def _ended(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def test_the_route_relay_picks_the_tokens_the_shards_in_process_pick(shards, local_chain, prompt_ids):
    prompt = np.asarray(prompt_ids[0], np.int32)
    relay = Relay([shard.path for shard in shards], threads=1, n_ctx=N_CTX)
    pids = relay.pids
    try:
        with local_chain.new_session(N_CTX) as session:
            logits, picked = session.append(0, prompt), relay.append(0, prompt)
            tokens = []
            for step in range(STEPS):
                token = int(np.argmax(logits[-1]))
                assert picked.dtype == np.int32 and picked.tolist() == [token], step
                tokens.append(token)
                position = len(prompt) + step
                logits, picked = session.append(position, [token]), relay.append(position, np.asarray([token], np.int32))
        relay.reset()
        assert relay.append(0, prompt.astype(np.int64)).tolist() == tokens[:1]  # from position 0 again, the same first token; ids sent as int32
    finally:
        relay.close()
    assert len(pids) == 3 and _ended(pids) and relay.pids == []


def test_the_middle_shard_relay_returns_the_rows_of_the_shard_in_process(shards, prompt_ids):
    prompt = np.asarray(prompt_ids[1], np.int32)
    relay = Relay([shards[1].path], threads=1, n_ctx=N_CTX)
    try:
        with ShardModel(shards[0].path) as first, ShardModel(shards[1].path) as middle, first.new_context(N_CTX) as feed, middle.new_context(N_CTX) as context:
            rows = feed.append(0, tokens=prompt)
            assert np.array_equal(relay.append(0, rows), context.append(0, hidden=rows))  # a prefill: every row's hidden state
            for position in range(len(prompt), len(prompt) + STEPS):
                row = feed.append(position, tokens=prompt[position % len(prompt) : position % len(prompt) + 1])
                assert np.array_equal(relay.append(position, row), context.append(position, hidden=row)), position
    finally:
        relay.close()


def test_a_relay_process_that_cannot_load_its_shard_fails_the_relay_with_its_exit_code(tmp_path):
    missing = tmp_path / "no-such-shard.gguf"
    with pytest.raises(RelayFailed, match=r"the relay process of no-such-shard.gguf \(pid \d+\) failed during its load: .*exit code [1-9]"):
        Relay([missing], threads=1, n_ctx=N_CTX)

"""Sampling on the last shard: greedy is the argmax exactly, seeded sampling is reproducible, and a
daemon returns the token instead of n_vocab floats."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.client.client import KvpoolError
from kvpool.wire.sampling import Sampling
from tests.support.chains import daemon_chain
from tests.support.daemons import DaemonProcess
from workers.runtime.sampling import sample

pytestmark = pytest.mark.timeout(1800)


def _logits(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(4096) * 3).astype(np.float32)


def test_greedy_and_top_k_1_and_a_tiny_top_p_are_the_argmax():
    for seed in range(20):
        logits = _logits(seed)
        best = int(np.argmax(logits))
        assert sample(logits, Sampling(), 3).token == best
        assert sample(logits, Sampling(temperature=1.0, top_k=1, seed=seed), 3).token == best
        assert sample(logits, Sampling(temperature=1.0, top_p=1e-9, seed=seed), 3).token == best


def test_seeded_sampling_depends_on_seed_and_position_only_and_follows_the_distribution():
    logits = _logits(1)
    spec = Sampling(temperature=1.0, top_k=50, top_p=0.95, seed=11)
    assert [sample(logits, spec, p).token for p in range(30)] == [sample(logits.copy(), spec, p).token for p in range(30)]
    assert len({sample(logits, spec, p).token for p in range(200)}) > 1  # it does sample
    top50 = set(np.argsort(-logits)[:50].tolist())
    assert all(sample(logits, spec, p).token in top50 for p in range(200))
    draws = [sample(np.array([0.0, np.log(3.0)], np.float32), Sampling(temperature=1.0, seed=s), 0).token for s in range(2000)]
    assert 0.70 < sum(draws) / len(draws) < 0.80  # p(token 1) = 3/4


def test_logprobs_are_the_log_softmax_of_the_unscaled_logits():
    logits = _logits(2)
    picked = sample(logits, Sampling(temperature=0.7, seed=1, logprobs=5), 9)
    reference = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert picked.top_ids == np.argsort(-logits)[:5].tolist()
    assert np.allclose(picked.top_logprobs, reference[picked.top_ids])


def test_a_daemon_samples_on_the_last_shard_only(model_path, shards, socket_dir, whole_model, prompt_ids):
    prompt = prompt_ids[0][:12]
    whole = DaemonProcess(model_path, socket_dir / "whole.sock", "--threads", "1", "--n-ctx", "128", "--max-sessions", "2")
    first = DaemonProcess(shards[0].path, socket_dir / "first.sock", "--threads", "1", "--n-ctx", "128", "--max-sessions", "1")
    try:
        with whole.client() as client, whole_model.new_context(128) as reference:
            expected = reference.append(0, tokens=np.asarray(prompt, np.int32))[-1]
            got = client.append("greedy", 1, 0, tokens=prompt, sample=Sampling(logits=True, logprobs=3))
            assert got.token == int(np.argmax(expected)) and np.array_equal(got.rows[-1], expected)
            assert got.top_ids[0] == got.token and len(got.top_logprobs) == 3
            lean = client.append("greedy", 1, 12, tokens=[got.token], sample=Sampling())
            assert lean.rows.shape == (0, whole_model.shape.n_vocab) and lean.length == 13
            assert lean.token == int(np.argmax(reference.append(12, tokens=np.asarray([got.token], np.int32))[-1]))
            seeded = Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=5)
            runs = []
            for name in ("a", "b"):
                tokens, length = list(prompt), 0
                for _ in range(6):
                    result = client.append(name, 1, length, tokens=tokens[length:], sample=seeded)
                    length = result.length
                    tokens.append(result.token)
                runs.append(tokens)
                client.release(name, 1)
            assert runs[0] == runs[1]
            for bad in (Sampling(top_p=0.0), Sampling(top_k=10**6), Sampling(temperature=-1.0)):
                with pytest.raises(KvpoolError) as refused:
                    client.append("bad", 1, 0, tokens=prompt, sample=bad)
                assert refused.value.code == "bad_request"
        with first.client() as client, pytest.raises(KvpoolError) as refused:
            client.append("first", 1, 0, tokens=prompt, sample=Sampling())
        assert refused.value.code == "bad_request" and "last shard" in str(refused.value)
    finally:
        whole.stop()
        first.stop()


def test_generation_through_three_daemons_sampling_on_the_last_equals_the_in_process_greedy(shards, socket_dir, local_chain, prompt_ids):
    from kvpool.local.generate import greedy_tokens
    from kvpool.router.router import Router

    prompt = prompt_ids[1][:10]
    with daemon_chain([shard.path for shard in shards], socket_dir, "gen", "--threads", "1", "--n-ctx", "128", "--max-sessions", "1") as daemons:
        clients = [daemon.client() for daemon in daemons]
        routed = list(Router(clients).session("gen", epoch=1).generate(prompt, 12))
        for client in clients:
            client.close()
    with local_chain.new_session(128) as session:
        expected = list(greedy_tokens(session.append, prompt, 12))
    assert routed == expected

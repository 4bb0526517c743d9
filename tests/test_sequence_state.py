"""A sequence's saved state restores exactly into a fresh context (the warm tier's primitive)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import EVEN_SPLIT
from workers.runtime.errors import BadInput, RestoreFailed
from workers.runtime.model import ShardModel

N_CTX = 128


def _rows(model: ShardModel, prompt: list[int]):
    """What each shard takes: the prompt's token ids on a first shard, fixed hidden states elsewhere."""
    if model.shape.is_first:
        return {"tokens": np.asarray(prompt, np.int32)}
    rng = np.random.default_rng(len(prompt))
    return {"hidden": (rng.standard_normal((len(prompt), model.shape.n_embd)) * 0.5).astype(np.float32)}


def _next(model: ShardModel, context, start: int, token: int) -> np.ndarray:
    return context.append(start, **_rows(model, [token]))


@pytest.fixture(scope="module", params=["whole", "middle", "last"])
def model(request, model_path, shard_sets):
    path = {"whole": model_path, "middle": shard_sets[EVEN_SPLIT][1].path, "last": shard_sets[EVEN_SPLIT][2].path}[request.param]
    with ShardModel(path) as loaded:
        yield loaded


def test_a_restored_sequence_continues_bit_identically(model, prompt_ids):
    prompt = prompt_ids[0]
    with model.new_context(N_CTX) as original:
        original.append(0, **_rows(model, prompt))
        blob = original.save_state()
        expected = _next(model, original, len(prompt), 42)
    with model.new_context(N_CTX) as restored:
        assert restored.restore_state(blob, len(prompt)) == len(prompt)
        assert np.array_equal(_next(model, restored, len(prompt), 42), expected)


def test_a_restore_cut_shorter_equals_a_truncate(model, prompt_ids):
    prompt = prompt_ids[1]
    keep = len(prompt) // 2
    with model.new_context(N_CTX) as original:
        original.append(0, **_rows(model, prompt))
        blob = original.save_state()
        original.truncate(keep)
        expected = _next(model, original, keep, 7)
    with model.new_context(N_CTX) as restored:
        assert restored.restore_state(blob, keep) == keep
        assert np.array_equal(_next(model, restored, keep, 7), expected)


def test_refused_states_raise_restore_failed(model, prompt_ids):
    prompt = prompt_ids[0]
    with model.new_context(N_CTX) as original:
        original.append(0, **_rows(model, prompt))
        blob = original.save_state()
    for broken in (blob[: len(blob) // 2], b"\x00" * 16):
        with model.new_context(N_CTX) as target, pytest.raises(RestoreFailed):
            target.restore_state(broken, len(prompt))
    with model.new_context(N_CTX) as target, pytest.raises(RestoreFailed):
        target.restore_state(blob, len(prompt) + 1)  # more positions than the state holds
    with model.new_context(N_CTX) as busy:
        busy.append(0, **_rows(model, prompt))
        with pytest.raises(BadInput):
            busy.restore_state(blob, len(prompt))

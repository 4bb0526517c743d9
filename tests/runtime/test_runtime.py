"""Shard runtime on the real bundled model: chains of shards are bit-exact with the whole model."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from kvpool.local.chain import LocalChain
from tests.conftest import EVEN_SPLIT, UNEVEN_SPLIT
from tests.support.chains import greedy_with_logits
from workers.runtime.errors import BadInput, Cancelled, ContextFull, PositionMismatch
from workers.runtime.model import ShardModel

N_CTX = 256
GREEDY_TOKENS = 32


@pytest.fixture(scope="module", params=[EVEN_SPLIT, UNEVEN_SPLIT])
def chain(request, shard_sets):
    with LocalChain([shard.path for shard in shard_sets[request.param]]) as chain:
        yield chain


def test_whole_model_runtime_matches_llama_cpp_python(model_path, whole_model, prompt_ids):
    """Anchor: our runtime on the unsharded file equals llama-cpp-python's own Llama, same parameters."""
    prompt = prompt_ids[1]
    llama = llama_cpp.Llama(
        model_path=str(model_path), n_ctx=N_CTX, n_batch=512, n_threads=1, n_threads_batch=1,
        flash_attn=False, verbose=False,
    )
    try:
        llama.eval(prompt)
        expected = np.ctypeslib.as_array(llama._ctx.get_logits_ith(-1), shape=(llama.n_vocab(),)).copy()
    finally:
        llama.close()
    with whole_model.new_context(N_CTX) as context:
        logits = context.append(0, tokens=prompt)
    assert logits.shape == (1, 49152)
    assert np.abs(logits[0] - expected).max() == 0.0


@pytest.mark.parametrize("prompt_index", [0, 1])
def test_chain_reproduces_whole_model_exactly(chain, whole_model, prompt_ids, prompt_index):
    prompt = prompt_ids[prompt_index]
    with whole_model.new_context(N_CTX) as whole, chain.new_session(N_CTX) as sharded:
        expected_tokens, expected_logits = greedy_with_logits(
            lambda start, tokens: whole.append(start, tokens=np.asarray(tokens)), prompt, GREEDY_TOKENS
        )
        tokens, logits = greedy_with_logits(sharded.append, prompt, GREEDY_TOKENS)
    assert len(expected_tokens) == GREEDY_TOKENS
    assert tokens == expected_tokens
    assert np.abs(logits - expected_logits).max() == 0.0


def test_a_prefill_of_several_batches_through_the_chain_equals_the_whole_model(chain, whole_model, prompt_ids):
    """600 rows: two llama batches (512 + 88) on every shard. The first shard marks one output row per batch
    (its lookahead layer, never run, is where llama.cpp prunes), and still hands every row on exactly."""
    assert chain.models[0].lookahead_layers == 1
    prompt = (prompt_ids[1] * 20)[:600]
    with whole_model.new_context(640) as whole, chain.new_session(640) as sharded:
        expected = whole.append(0, tokens=np.asarray(prompt), output_rows="all")
        hidden = sharded.contexts[0].append(0, tokens=np.asarray(prompt))
        assert hidden.shape == (600, 576)
        for context in sharded.contexts[1:-1]:
            hidden = context.append(0, hidden=hidden)
        logits = sharded.contexts[-1].append(0, hidden=hidden, output_rows="all")
        assert np.abs(logits - expected).max() == 0.0
        token = int(np.argmax(expected[-1]))
        assert np.array_equal(sharded.append(600, [token]), whole.append(600, tokens=np.asarray([token])))


def test_non_final_shards_return_every_row_as_float32_hidden_states(chain, prompt_ids):
    prompt = prompt_ids[1]
    with chain.new_session(N_CTX) as session:
        first = session.contexts[0]
        hidden = first.append(0, tokens=np.asarray(prompt))
        assert hidden.dtype == np.float32 and hidden.shape == (len(prompt), 576)
        assert np.isfinite(hidden).all() and np.abs(hidden).max() > 0
        middle = session.contexts[1].append(0, hidden=hidden)
        assert middle.shape == hidden.shape and not np.array_equal(middle, hidden)
        all_logits = session.contexts[2].append(0, hidden=middle, output_rows="all")
        assert all_logits.shape == (len(prompt), 49152)
        assert all(context.length == len(prompt) for context in session.contexts)


@pytest.mark.parametrize("chunk", [2, 5, 8, 13])
def test_chunked_prefill_equals_one_prefill(chain, prompt_ids, chunk):
    prompt = prompt_ids[1]
    with chain.new_session(N_CTX) as whole_prefill, chain.new_session(N_CTX) as chunked:
        expected = whole_prefill.append(0, prompt)
        for start in range(0, len(prompt), chunk):
            logits = chunked.append(start, prompt[start : start + chunk])
        assert chunked.length == whole_prefill.length == len(prompt)
        assert np.abs(logits - expected).max() == 0.0
        # and the sessions stay identical when decoding continues
        token = int(np.argmax(expected[-1]))
        assert np.array_equal(chunked.append(len(prompt), [token]), whole_prefill.append(len(prompt), [token]))


def test_truncate_then_continue_equals_fresh_run_of_shorter_prefix(chain, prompt_ids):
    prompt = prompt_ids[1]
    keep = len(prompt) - 5
    continuation = prompt_ids[0][1:6]
    with chain.new_session(N_CTX) as truncated, chain.new_session(N_CTX) as fresh:
        truncated.append(0, prompt[:keep])
        truncated.append(keep, prompt[keep:])
        truncated.append(len(prompt), [42, 43, 44])
        assert truncated.truncate(keep) == keep
        assert all(context.length == keep for context in truncated.contexts)
        logits = truncated.append(keep, continuation)
        fresh.append(0, prompt[:keep])
        expected = fresh.append(keep, continuation)
        assert np.abs(logits - expected).max() == 0.0


def test_position_and_input_errors_leave_the_session_untouched(model_path, shard_sets, prompt_ids):
    prompt = prompt_ids[0]
    first_path, middle_path = (shard.path for shard in shard_sets[EVEN_SPLIT][:2])
    with ShardModel(first_path) as first, ShardModel(middle_path) as middle:
        with first.new_context(32) as context:
            hidden = context.append(0, tokens=prompt[:10])
            with pytest.raises(PositionMismatch) as gap:
                context.append(11, tokens=prompt[10:12])
            assert gap.value.length == 10
            with pytest.raises(PositionMismatch):
                context.append(9, tokens=prompt[10:12])
            with pytest.raises(ContextFull) as full:
                context.append(10, tokens=[1] * 23)
            assert full.value.length == 10
            for bad_tokens in ([-1], [49152], [10**9]):
                with pytest.raises(BadInput):
                    context.append(10, tokens=bad_tokens)
            with pytest.raises(BadInput):
                context.append(10, tokens=[])
            with pytest.raises(BadInput):
                context.append(10, hidden=np.zeros((1, 576), np.float32))
            with pytest.raises(PositionMismatch):
                context.truncate(11)
            with pytest.raises(PositionMismatch):
                context.truncate(-1)
            assert context.length == 10
            # the errors changed nothing: the next rows equal a run that never saw them
            rest = context.append(10, tokens=prompt[10:16])
            reference_context = first.new_context(32)
            reference_context.append(0, tokens=prompt[:10])
            assert np.array_equal(rest, reference_context.append(10, tokens=prompt[10:16]))
            reference_context.close()
        with middle.new_context(16) as context:
            for bad_hidden in (
                np.zeros((2, 575), np.float32),
                np.zeros((2, 576), np.float64),
                np.zeros((576,), np.float32),
            ):
                with pytest.raises(BadInput):
                    context.append(0, hidden=bad_hidden)
            with pytest.raises(BadInput):
                context.append(0, tokens=[1, 2])
            assert context.length == 0
            assert context.append(0, hidden=hidden[:4]).shape == (4, 576)


def test_cancel_rolls_back_and_continuation_stays_exact(chain, prompt_ids):
    prompt = prompt_ids[1]
    with chain.new_session(N_CTX) as session, chain.new_session(N_CTX) as reference:
        session.append(0, prompt[:8])
        middle = session.contexts[1]
        flag = ctypes.c_int32.from_address(middle.abort_flag_address)
        flag.value = 1
        with pytest.raises(Cancelled) as cancelled:
            session.append(8, prompt[8:])
        assert cancelled.value.length == 8
        flag.value = 0
        # the first shard took the rows before the middle one was cancelled: the router rolls it back
        assert session.contexts[0].length == len(prompt) and middle.length == 8
        session.truncate(8)
        logits = session.append(8, prompt[8:])
        reference.append(0, prompt[:8])
        assert np.abs(logits - reference.append(8, prompt[8:])).max() == 0.0


def test_close_is_idempotent_and_model_close_frees_contexts(model_path):
    model = ShardModel(model_path)
    context = model.new_context(64)
    context.append(0, tokens=[1, 2, 3])
    model.close()
    assert context.closed
    context.close()
    model.close()
    with pytest.raises(RuntimeError):
        context.append(3, tokens=[4])

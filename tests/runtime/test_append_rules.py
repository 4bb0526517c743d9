"""Each rule in one place (issue 18, item 3, the worker side): an append's validation is kvpool.wire.checks for
the daemon, the direct channel and the worker's runtime alike; a reply's sampled token is one function; a llama
context is created and registered by its model only."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest

from kvpool.wire.checks import append_rows, check_position
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import Append
from kvpool.wire.sampling import Sampling
from kvpool.wire.shape import ShardShape
from tests.conftest import EVEN_SPLIT
from tests.support.worker_server import worker_server
from workers.runtime.batched import BatchedShardContext
from workers.runtime.context import ShardContext
from workers.runtime.errors import ShardRuntimeError
from workers.runtime.model import ShardModel
from workers.runtime.sampling import sample
from workers.server.commands import Failed, OpenContext, RunAppend
from workers.server.segment import SegmentRegions

N_CTX = 16
FIRST = ShardShape(layer_start=0, layer_stop=10, total_layers=30, n_embd=576, n_vocab=49152)


@pytest.fixture(scope="module")
def first_model(shard_sets):
    with ShardModel(shard_sets[EVEN_SPLIT][0].path) as model:
        yield model


def _daemon_refusal(request: Append, shape: ShardShape, length: int) -> RequestFailed:
    with pytest.raises(RequestFailed) as refused:
        rows = append_rows(request, shape, max_rows=1024, length=length)
        check_position(request.start_pos, length, rows.shape[0], N_CTX)
    return refused.value


@pytest.mark.parametrize(
    ("start_pos", "tokens", "hidden_rows"),
    [
        (3, [-1], None),  # an id below the vocabulary
        (3, [49152], None),  # an id at n_vocab, one past the last
        (3, [], None),  # no row
        (3, None, 1),  # hidden states on the first shard
        (4, [7], None),  # a gap after the session's length
        (2, [7], None),  # an overlap
        (3, [7] * (N_CTX - 2), None),  # one row past n_ctx
    ],
)
def test_a_context_refuses_an_append_as_the_daemon_does(first_model, start_pos, tokens, hidden_rows):
    """The same code, message and length from the wire's checks and from a worker's ShardContext: one rule."""
    hidden = None if hidden_rows is None else np.zeros((hidden_rows, FIRST.n_embd), np.float32)
    request = Append(
        session_id="s", epoch=1, start_pos=start_pos, tokens=tokens, hidden=None if hidden is None else hidden.tobytes()
    )
    expected = _daemon_refusal(request, first_model.shape, 3)
    with first_model.new_context(N_CTX) as context:
        context.append(0, tokens=[1, 2, 3])
        with pytest.raises(ShardRuntimeError) as refused:
            context.append(start_pos, tokens=tokens, hidden=hidden)
        assert (refused.value.code, str(refused.value), refused.value.length) == (expected.code, str(expected), 3)
        assert context.length == 3


def test_the_edge_of_the_context_is_accepted(first_model):
    with first_model.new_context(N_CTX) as context:
        context.append(0, tokens=[1, 2, 3])
        assert context.append(3, tokens=[7] * (N_CTX - 3)).shape == (N_CTX - 3, FIRST.n_embd)
        assert context.length == N_CTX


def test_token_ids_past_int64_are_a_bad_request_on_the_wire():
    for tokens in ([2**63], [2**64 - 1], [-1, 2**63]):
        refused = _daemon_refusal(Append(session_id="s", epoch=1, start_pos=0, tokens=tokens), FIRST, 0)
        assert refused.code == "bad_request"


@pytest.mark.parametrize("n_rows", [-1, 0, N_CTX + 1])
def test_a_worker_refuses_a_row_count_outside_its_input_region(first_model, n_rows, resource_tracker_running):
    """A negative count must not read the whole segment as token ids (np.frombuffer's count -1)."""
    segment = shared_memory.SharedMemory(create=True, size=SegmentRegions(N_CTX * 4, N_CTX * FIRST.n_embd * 4).total_bytes)
    server = worker_server(first_model, segment, N_CTX, FIRST.n_embd, N_CTX)
    try:
        server.handle(OpenContext(n_ctx=N_CTX))
        reply = server.handle(RunAppend(start_pos=0, n_rows=n_rows))
        assert isinstance(reply, Failed) and (reply.code, reply.length) == ("bad_request", 0)
        assert server.context.length == 0
        edge = server.handle(RunAppend(start_pos=0, n_rows=N_CTX))  # the region's last row is inside it
        assert not isinstance(edge, Failed) and edge.length == N_CTX
    finally:
        server.close()
        segment.close()
        segment.unlink()


def test_answer_carries_the_sampled_token_and_rows_only_when_asked():
    from workers.runtime.sampling import answer  # the one function the three servers' replies come from

    logits = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    plain = answer(logits, None, 5)
    assert plain.rows is logits and plain.reply_fields == {"token": -1, "top_ids": [], "top_logprobs": []}
    for sampling in (Sampling(logprobs=3), Sampling(temperature=0.8, seed=4, logits=True)):
        picked = sample(logits[-1], sampling, 5)
        reply = answer(logits, sampling, 5)
        assert reply.reply_fields == {"token": picked.token, "top_ids": picked.top_ids, "top_logprobs": picked.top_logprobs}
        assert reply.rows.shape == ((2, 64) if sampling.logits else (0, 64))


def test_the_model_closes_every_context_made_on_it(shard_sets):
    with ShardModel(shard_sets[EVEN_SPLIT][0].path) as model:
        direct = ShardContext(model, N_CTX, n_batch=N_CTX, abort_flag_address=None)  # not through new_context
        made = model.new_context(N_CTX)
        batched = BatchedShardContext(model, N_CTX, 2, n_batch=N_CTX)
        closed_first = model.new_context(N_CTX)
        closed_first.close()
    assert direct.closed and made.closed and batched.closed and closed_first.closed


def test_append_checked_is_append_on_rows_the_wire_checked(shard_sets):
    """The direct channel's path (issue 29, item 4): rows checked once by kvpool.wire.checks, then
    ShardContext.append_checked, one output array written again at every decode step (what the channel keeps),
    gives a first shard's hidden states and a last shard's logits bit-identical to append() into fresh arrays."""
    first_path, last_path = shard_sets[EVEN_SPLIT][0].path, shard_sets[EVEN_SPLIT][-1].path
    prompt = [1, 9, 31, 77, 120, 5]
    with ShardModel(first_path) as first, ShardModel(last_path) as last:
        with first.new_context(N_CTX) as plain_first, first.new_context(N_CTX) as checked_first, \
             last.new_context(N_CTX) as plain_last, last.new_context(N_CTX) as checked_last:
            hidden = plain_first.append(0, tokens=prompt, output_rows="all")
            request = Append(session_id="s", epoch=1, start_pos=0, tokens=prompt)
            rows = append_rows(request, first.shape, max_rows=N_CTX, length=0)
            assert np.array_equal(checked_first.append_checked(0, rows), hidden)
            expected_logits = plain_last.append(0, hidden=hidden)
            assert np.array_equal(checked_last.append_checked(0, hidden), expected_logits)
            kept_hidden = np.empty((1, first.shape.n_embd), np.float32)
            kept_logits = np.empty((1, last.shape.n_vocab), np.float32)
            seen = []
            for step, token in enumerate((40, 41, 42)):
                position = len(prompt) + step
                expected_hidden = plain_first.append(position, tokens=[token])
                request = Append(session_id="s", epoch=1, start_pos=position, tokens=[token])
                rows = append_rows(request, first.shape, max_rows=N_CTX, length=checked_first.length)
                check_position(position, checked_first.length, 1, N_CTX)
                got_hidden = checked_first.append_checked(position, rows, out=kept_hidden)
                assert got_hidden is kept_hidden and np.array_equal(got_hidden, expected_hidden)
                expected = plain_last.append(position, hidden=expected_hidden)
                got = checked_last.append_checked(position, kept_hidden, out=kept_logits)
                assert got is kept_logits and np.array_equal(got, expected)
                seen.append(got.copy())
            assert checked_first.length == checked_last.length == len(prompt) + 3
            assert not np.array_equal(seen[0], seen[1])  # each step wrote its own logits there

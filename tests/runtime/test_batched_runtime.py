"""Batched sequences on the real bundled model: isolation is exact; against one context per session
the difference is measured and kept here as a tolerance.

A script is a list of calls; each call appends token rows to some sequences of one batched context (or
one batched context per shard of a chain, first to last). Sequence TARGET is the session under test.
"""

from __future__ import annotations

import ctypes
import random
import threading

import llama_cpp
import numpy as np
import pytest

from tests.conftest import PROCESS_MODE_TOLERANCE
from tests.support.chains import greedy_with_logits
from tests.support.daemons import HANG_GUARD_S
from workers.runtime.batched import BatchedShardContext, SeqAppend, plan_ubatches
from workers.runtime.errors import BadInput, Cancelled, ContextFull, PositionMismatch
from workers.runtime.model import ShardModel

N_SEQS = 4
N_CTX = 128
N_BATCH = 64
STEPS = 8
TARGET = 1
PROMPTS = (
    "What is the capital of France?",
    "Tell me a long story about a dragon who lived under a mountain and collected books.",
    "Name three colours.",
    "Why is the sky blue?",
)

Call = list[tuple[int, int, list[int]]]  # (sequence, start_pos, token ids)


@pytest.fixture(scope="module")
def split_models(local_chain):
    """The even split's shards, first to last."""
    return local_chain.models


@pytest.fixture(scope="module")
def sessions(tokenizer, whole_model):
    """Per prompt: the prompt plus STEPS greedy tokens of process mode, and the logits each came from."""
    streams, logits = [], []
    for text in PROMPTS:
        prompt = tokenizer.encode(tokenizer.chat_prompt(text))
        with whole_model.new_context(N_CTX) as context:
            tokens, rows = greedy_with_logits(lambda start, tokens: context.append(start, tokens=np.asarray(tokens)), prompt, STEPS)
        streams.append((prompt, tokens))
        logits.append(rows)
    return streams, logits


def decode_script(streams: dict[int, list[int]], prefill: dict[int, int]) -> list[Call]:
    """Every sequence prefills prefill[seq] tokens in one call, then decodes its stream one token per call."""
    calls: list[Call] = [[(seq, 0, stream[: prefill[seq]]) for seq, stream in streams.items()]]
    for step in range(max(len(stream) - prefill[seq] for seq, stream in streams.items())):
        calls.append([
            (seq, prefill[seq] + step, stream[prefill[seq] + step : prefill[seq] + step + 1])
            for seq, stream in streams.items()
            if prefill[seq] + step < len(stream)
        ])
    return calls


def replay(contexts: list[BatchedShardContext], calls: list[Call]) -> list[list[dict[int, np.ndarray]]]:
    """Outputs of every call on every shard: result[call][shard][seq]."""
    result = []
    for call in calls:
        rows: list = [np.asarray(tokens, dtype=np.int32) for _, _, tokens in call]
        per_shard = []
        for context in contexts:
            rows = context.append_many([SeqAppend(seq, start, r) for (seq, start, _), r in zip(call, rows)])
            per_shard.append({seq: out for (seq, _, _), out in zip(call, rows)})
        result.append(per_shard)
    return result


def target_rows(result: list[list[dict[int, np.ndarray]]], shard: int, seq: int = TARGET) -> list[np.ndarray]:
    return [per_shard[shard][seq] for per_shard in result if seq in per_shard[shard]]


def max_difference(left: list[np.ndarray], right: list[np.ndarray]) -> float:
    assert len(left) == len(right) and all(a.shape == b.shape for a, b in zip(left, right))
    return max(float(np.abs(a - b).max()) for a, b in zip(left, right))


def contexts_on(models: list[ShardModel], n_ctx: int = N_CTX, n_batch: int = N_BATCH) -> list[BatchedShardContext]:
    return [BatchedShardContext(model, n_ctx, N_SEQS, n_batch=n_batch) for model in models]


def close_all(contexts: list[BatchedShardContext]) -> None:
    for context in contexts:
        context.close()


def random_stream(rng: np.random.Generator, length: int) -> list[int]:
    return [int(token) for token in rng.integers(0, 49152, length)]


@pytest.fixture(params=["whole", "3-part split"])
def chain_models(request, whole_model, split_models):
    return [whole_model] if request.param == "whole" else split_models


def test_plan_cuts_single_ubatch_calls_and_keeps_each_append_partition():
    rng = random.Random(0)
    for _ in range(300):
        n_batch = rng.choice([1, 3, 8, 64])
        seqs = rng.sample(range(8), rng.randint(1, 8))
        counts = [rng.choice([1, 1, 2, 5, 17, 70]) for _ in seqs]
        plan = plan_ubatches(seqs, counts, n_batch)
        covered = {item: [] for item in range(len(seqs))}
        for call in plan:
            lengths = {piece.row_stop - piece.row_start for piece in call}
            call_seqs = [piece.seq for piece in call]
            # what llama.cpp's split_equal keeps as one ubatch: equal rows, consecutive increasing ids
            assert len(lengths) == 1 and lengths.pop() * len(call) <= n_batch
            assert call_seqs == list(range(call_seqs[0], call_seqs[0] + len(call)))
            for piece in call:
                covered[piece.item].append((piece.row_start, piece.row_stop))
        for item, count in enumerate(counts):
            expected = [(start, min(count, start + n_batch)) for start in range(0, count, n_batch)]
            assert covered[item] == expected  # ShardContext's chunks of the same append, in order
    ones = plan_ubatches([0, 1, 2, 3], [1, 1, 1, 1], 64)
    assert [[piece.seq for piece in call] for call in ones] == [[0, 1, 2, 3]]
    gap = plan_ubatches([3, 0, 1], [1, 1, 1], 64)
    assert [[piece.seq for piece in call] for call in gap] == [[0, 1], [3]]
    mixed = plan_ubatches([0, 1, 2, 3], [10, 1, 1, 1], 64)
    assert [[(piece.seq, piece.row_stop) for piece in call] for call in mixed] == [[(1, 1), (2, 1), (3, 1)], [(0, 10)]]


def test_isolation_is_exact_whatever_the_other_sequences_hold(chain_models, sessions):
    """Same shapes, other contents: the target's rows on every shard are bit-identical."""
    streams, _ = sessions
    rng = np.random.default_rng(0)
    full = {seq: prompt + tokens[:-1] for seq, (prompt, tokens) in enumerate(streams)}
    prefill = {seq: len(streams[seq][0]) for seq in full}
    noise = {seq: full[seq] if seq == TARGET else random_stream(rng, len(full[seq])) for seq in full}
    runs = []
    for script_streams in (full, noise):
        contexts = contexts_on(chain_models)
        try:
            runs.append(replay(contexts, decode_script(script_streams, prefill)))
        finally:
            close_all(contexts)
    for shard in range(len(chain_models)):
        assert max_difference(target_rows(runs[0], shard), target_rows(runs[1], shard)) == 0.0
    # and the others really differed
    assert max_difference(target_rows(runs[0], 0, seq=0), target_rows(runs[1], 0, seq=0)) > 0.0


def test_isolation_is_exact_when_a_neighbour_spans_more_kv_cells(split_models):
    """llama.cpp attends over the longest stream of the call (padded to 256 cells); the extra cells are
    masked, and the target's logits do not move."""
    last = split_models[-1]
    rng = np.random.default_rng(1)
    target = rng.standard_normal((12, 576)).astype(np.float32)
    outputs = []
    for neighbour_rows in (300, 20):
        with BatchedShardContext(last, 512, 2, n_batch=512) as context:
            neighbour = rng.standard_normal((neighbour_rows, 576)).astype(np.float32)
            rows = [context.append_many([SeqAppend(0, 0, target[:8]), SeqAppend(1, 0, neighbour)])[0]]
            for step in range(4):
                rows += context.append_many([
                    SeqAppend(0, 8 + step, target[8 + step : 9 + step]),
                    SeqAppend(1, neighbour_rows + step, neighbour[:1]),
                ])[:1]
            outputs.append(rows)
    assert max_difference(outputs[0], outputs[1]) == 0.0


def test_a_session_replayed_alone_reproduces_its_rows(split_models, sessions):
    """(b) Replayed with the same call shapes (filler sequences beside it), in another sequence slot of a
    fresh context: exact. Replayed truly alone: within the process-mode tolerance."""
    streams, _ = sessions
    rng = np.random.default_rng(2)
    full = {seq: prompt + tokens[:-1] for seq, (prompt, tokens) in enumerate(streams)}
    prefill = {seq: len(streams[seq][0]) for seq in full}
    moved_to = 3
    moved = {seq: random_stream(rng, len(full[seq])) for seq in full}
    moved[moved_to], moved[TARGET] = full[TARGET], random_stream(rng, len(full[moved_to]))
    moved_prefill = dict(prefill)
    moved_prefill[moved_to], moved_prefill[TARGET] = prefill[TARGET], prefill[moved_to]
    scripts = {
        "original": (decode_script(full, prefill), TARGET),
        "moved, same shapes": (decode_script(dict(sorted(moved.items())), moved_prefill), moved_to),
        "alone": (decode_script({moved_to: full[TARGET]}, {moved_to: prefill[TARGET]}), moved_to),
    }
    rows = {}
    for name, (calls, seq) in scripts.items():
        contexts = contexts_on(split_models)
        try:
            result = replay(contexts, calls)
        finally:
            close_all(contexts)
        rows[name] = [target_rows(result, shard, seq) for shard in range(3)]
    for shard in range(3):
        assert max_difference(rows["original"][shard], rows["moved, same shapes"][shard]) == 0.0
        assert max_difference(rows["original"][shard], rows["alone"][shard]) <= PROCESS_MODE_TOLERANCE


def test_matches_process_mode_within_the_measured_tolerance(whole_model, split_models, sessions):
    """(c) Four sessions batched against one ShardContext each, same appends: greedy agreement and the
    largest logit difference; a batched chain of shards against the batched whole model: exact."""
    streams, process_logits = sessions
    full = {seq: prompt + tokens[:-1] for seq, (prompt, tokens) in enumerate(streams)}
    prefill = {seq: len(streams[seq][0]) for seq in full}
    calls = decode_script(full, prefill)
    whole = contexts_on([whole_model])
    chain = contexts_on(split_models)
    try:
        batched = replay(whole, calls)
        sharded = replay(chain, calls)
    finally:
        close_all(whole + chain)
    worst, agreed = 0.0, 0
    for seq in full:
        logits = np.concatenate(target_rows(batched, 0, seq))
        expected = process_logits[seq]
        assert logits.shape == expected.shape == (STEPS, 49152)
        worst = max(worst, float(np.abs(logits - expected).max()))
        agreed += int((logits.argmax(axis=1) == expected.argmax(axis=1)).sum())
        margins = np.sort(expected, axis=1)[:, -1] - np.sort(expected, axis=1)[:, -2]
        clear_winner = margins > 2 * PROCESS_MODE_TOLERANCE
        assert (logits.argmax(axis=1) == expected.argmax(axis=1))[clear_winner].all()
    print(f"batched vs process mode: max |logit diff| {worst}, greedy agreement {agreed}/{STEPS * len(full)}")
    assert worst <= PROCESS_MODE_TOLERANCE, f"measured {worst}: record it and widen PROCESS_MODE_TOLERANCE"
    for seq in full:
        assert max_difference(target_rows(batched, 0, seq), target_rows(sharded, 2, seq)) == 0.0


def test_a_prefill_chunk_beside_decoding_sessions_keeps_its_partition(whole_model, sessions):
    """llama.cpp alone would compute the chunk's first row beside the others' decode rows (split_equal);
    the planned calls keep the chunk whole, as process mode appends it."""
    streams, _ = sessions
    long_prompt = streams[TARGET][0]
    with BatchedShardContext(whole_model, N_CTX, N_SEQS, n_batch=N_BATCH) as batched:
        with whole_model.new_context(N_CTX) as process:
            head = 16
            process.append(0, tokens=np.asarray(long_prompt[:head]))
            expected = process.append(head, tokens=np.asarray(long_prompt[head:]), output_rows="all")
            others = [seq for seq in range(N_SEQS) if seq != TARGET]
            batched.append_many(
                [SeqAppend(TARGET, 0, np.asarray(long_prompt[:head]))]
                + [SeqAppend(seq, 0, np.asarray(streams[seq][0])) for seq in others]
            )
            calls_before = batched.decode_calls
            rows = batched.append_many(
                [SeqAppend(TARGET, head, np.asarray(long_prompt[head:]), "all")]
                + [SeqAppend(seq, len(streams[seq][0]), np.asarray(streams[seq][1][:1])) for seq in others]
            )
            assert batched.decode_calls - calls_before == 3  # the chunk; seq 0; seqs 2-3 (consecutive)
    assert rows[0].shape == expected.shape
    assert float(np.abs(rows[0] - expected).max()) <= PROCESS_MODE_TOLERANCE


def test_a_decode_step_of_every_session_is_one_llama_decode(whole_model):
    with BatchedShardContext(whole_model, N_CTX, N_SEQS, n_batch=N_BATCH) as context:
        context.append_many([SeqAppend(seq, 0, [1, 2, 3]) for seq in range(N_SEQS)])
        calls = context.decode_calls
        rows = context.append_many([SeqAppend(seq, 3, [4 + seq]) for seq in (2, 0, 3, 1)])
        assert context.decode_calls == calls + 1
        assert [row.shape for row in rows] == [(1, 49152)] * 4
        context.append_many([SeqAppend(seq, 4, [9]) for seq in (0, 1, 3)])
        assert context.decode_calls == calls + 3  # llama.cpp batches consecutive sequence ids only
        assert context.lengths == (5, 5, 4, 5)


def test_outputs_given_are_written_in_place_and_exact_and_bad_ones_touch_nothing(whole_model, split_models):
    """append_many's `outputs` (a batched worker's kept rows): each given array is the item's result, written in
    place, bit for bit what a new array gets; a wrong one (shape, dtype, layout, count, two overlapping) is
    BadInput with every sequence as it was."""
    rng = np.random.default_rng(5)
    for model in (whole_model, split_models[1]):
        width = model.shape.output_width
        head = [np.asarray([1, 2, 3]) if model.shape.is_first else rng.standard_normal((3, 576)).astype(np.float32) for _ in range(3)]
        steps = [[np.asarray([4 + seq + step]) if model.shape.is_first else rng.standard_normal((1, 576)).astype(np.float32) for seq in range(3)] for step in range(2)]
        with BatchedShardContext(model, N_CTX, N_SEQS, n_batch=N_BATCH) as context, BatchedShardContext(model, N_CTX, N_SEQS, n_batch=N_BATCH) as reference:
            for batched in (context, reference):
                batched.append_many([SeqAppend(seq, 0, head[seq]) for seq in range(3)])
            kept = np.full((2, width), np.nan, np.float32)
            for step, rows in enumerate(steps):
                items = [SeqAppend(seq, 3 + step, rows[seq]) for seq in range(3)]
                given = [kept[0:1], None, kept[1:2]]
                got = context.append_many(items, given)
                assert got[0] is given[0] and got[2] is given[2] and not np.shares_memory(got[1], kept)
                assert max_difference(got, reference.append_many(items)) == 0.0  # the second step writes over the first's rows
            lengths = context.lengths
            item = [SeqAppend(0, 5, steps[0][0]), SeqAppend(1, 5, steps[0][1])]
            for bad in (
                [np.empty((2, width), np.float32), None],
                [np.empty((1, width), np.float64), None],
                [np.empty((1, 2 * width), np.float32)[:, ::2], None],
                [np.empty((1, width), np.float32)],
                [kept[0:1], kept[0:1]],
                [kept[0:1], kept.reshape(-1)[width // 2 : width // 2 + width].reshape(1, width)],
            ):
                with pytest.raises(BadInput) as raised:
                    context.append_many(item, bad)
                assert raised.value.lengths == {0: 5, 1: 5}
                assert context.lengths == lengths


def test_truncate_and_clear_of_one_sequence_leave_the_others_bit_identical(whole_model, sessions):
    streams, _ = sessions
    prompts = [prompt for prompt, _ in streams]
    runs = []
    for edit in (False, True):
        with BatchedShardContext(whole_model, N_CTX, N_SEQS, n_batch=N_BATCH) as context:
            context.append_many([SeqAppend(seq, 0, prompt) for seq, prompt in enumerate(prompts)])
            for step in range(2):
                context.append_many([
                    SeqAppend(seq, len(prompt) + step, [streams[seq][1][step]]) for seq, prompt in enumerate(prompts)
                ])
            if edit:
                assert context.truncate(0, len(prompts[0]) - 3) == len(prompts[0]) - 3
                context.clear(2)
                assert context.lengths == (len(prompts[0]) - 3, len(prompts[1]) + 2, 0, len(prompts[3]) + 2)
            rows = []
            for step in range(3):
                rows.append(context.append_many([
                    SeqAppend(seq, context.length(seq), [streams[seq][1][2 + step]]) for seq in range(N_SEQS)
                ]))
            runs.append(rows)
    for seq in (1, 3):
        assert max_difference([step[seq] for step in runs[0]], [step[seq] for step in runs[1]]) == 0.0
    # the truncated sequence continues as a fresh session of the shorter prefix would
    keep = len(prompts[0]) - 3
    with whole_model.new_context(N_CTX) as process:
        process.append(0, tokens=np.asarray(prompts[0][:keep]))
        expected = [process.append(keep + step, tokens=[streams[0][1][2 + step]]) for step in range(3)]
    assert max_difference([step[0] for step in runs[1]], expected) <= PROCESS_MODE_TOLERANCE


def test_errors_leave_every_sequence_untouched(split_models, whole_model):
    first, middle, _ = split_models
    with BatchedShardContext(first, 32, N_SEQS, n_batch=16) as context:
        context.append_many([SeqAppend(0, 0, [1, 2, 3]), SeqAppend(2, 0, [4, 5])])
        good = SeqAppend(0, 3, [6])
        bad_calls = {
            PositionMismatch: [[good, SeqAppend(2, 3, [7])], [good, SeqAppend(1, 1, [7])]],
            ContextFull: [[good, SeqAppend(2, 2, [1] * 31)]],
            BadInput: [
                [good, SeqAppend(2, 2, [-1])],
                [good, SeqAppend(2, 2, [49152])],
                [good, SeqAppend(2, 2, [])],
                [good, SeqAppend(2, 2, np.zeros((1, 576), np.float32))],
                [good, SeqAppend(2, 2, [7], "every")],
                [good, SeqAppend(0, 3, [7])],
                [good, SeqAppend(N_SEQS, 0, [7])],
                [good, SeqAppend(-1, 0, [7])],
                [good, (2, 2)],
                [],
            ],
        }
        for error_type, calls in bad_calls.items():
            for call in calls:
                with pytest.raises(error_type) as raised:
                    context.append_many(call)
                if call and isinstance(call[-1], SeqAppend):
                    assert raised.value.lengths[0] == 3
                assert context.lengths == (3, 0, 2, 0)
        for seq, n in ((0, 4), (0, -1), (1, 1), (N_SEQS, 0)):
            with pytest.raises((PositionMismatch, BadInput)):
                context.truncate(seq, n)
        assert context.lengths == (3, 0, 2, 0)
        rows = context.append_many([SeqAppend(0, 3, [6, 7]), SeqAppend(2, 2, [8])])
        with BatchedShardContext(first, 32, N_SEQS, n_batch=16) as reference:
            reference.append_many([SeqAppend(0, 0, [1, 2, 3]), SeqAppend(2, 0, [4, 5])])
            expected = reference.append_many([SeqAppend(0, 3, [6, 7]), SeqAppend(2, 2, [8])])
        assert max_difference(rows, expected) == 0.0
    with BatchedShardContext(middle, 16, 2, n_batch=16) as context:
        for bad in (np.zeros((2, 575), np.float32), np.zeros((2, 576), np.float64), [1, 2]):
            with pytest.raises(BadInput):
                context.append_many([SeqAppend(1, 0, bad)])
        assert context.lengths == (0, 0)
        assert context.append_many([SeqAppend(1, 0, np.zeros((3, 576), np.float32))])[0].shape == (3, 576)


def test_cancel_mid_append_rolls_every_sequence_back_and_continuation_stays_exact(split_models, monkeypatch):
    """The middle shard's append runs 20 llama_decode calls; a canceller thread raises the abort flag once the
    third has returned (the append waits there until it has, on any machine), so the fourth is aborted and
    the rows of the three before sit in the KV cache and must be removed."""
    middle = split_models[1]
    rng = np.random.default_rng(3)
    head = [rng.standard_normal((5, 576)).astype(np.float32) for _ in range(N_SEQS)]
    tail = [rng.standard_normal((40, 576)).astype(np.float32) for _ in range(N_SEQS)]
    with BatchedShardContext(middle, N_CTX, N_SEQS, n_batch=8) as context:
        context.append_many([SeqAppend(seq, 0, head[seq]) for seq in range(N_SEQS)])
        flag = ctypes.c_int32.from_address(context.abort_flag_address)
        start = context.decode_calls
        third_returned, flag_raised = threading.Event(), threading.Event()
        decode, calls = llama_cpp.llama_decode, []

        def decode_and_wait_for_the_canceller(ctx, batch):
            status = decode(ctx, batch)
            calls.append(status)
            if len(calls) == 3:
                third_returned.set()
                assert flag_raised.wait(HANG_GUARD_S), "hang guard: the canceller never raised the abort flag"
            return status

        def cancel_after_three_calls() -> None:
            if third_returned.wait(HANG_GUARD_S):
                flag.value = 1
                flag_raised.set()

        canceller = threading.Thread(target=cancel_after_three_calls)
        canceller.start()
        try:
            with monkeypatch.context() as patched, pytest.raises(Cancelled) as cancelled:
                patched.setattr(llama_cpp, "llama_decode", decode_and_wait_for_the_canceller)
                context.append_many([SeqAppend(seq, 5, tail[seq]) for seq in range(N_SEQS)])
        finally:
            third_returned.set()  # a canceller still waiting (the append failed before its third call) ends
            canceller.join(HANG_GUARD_S)
            flag.value = 0
        assert context.decode_calls - start == 4  # three decoded, the fourth aborted
        assert cancelled.value.lengths == {seq: 5 for seq in range(N_SEQS)}
        assert context.lengths == (5,) * N_SEQS
        flag.value = 1
        with pytest.raises(Cancelled):
            context.append_many([SeqAppend(0, 5, tail[0][:1])])
        flag.value = 0
        rows = context.append_many([SeqAppend(seq, 5, tail[seq]) for seq in range(N_SEQS)])
    with BatchedShardContext(middle, N_CTX, N_SEQS, n_batch=8) as reference:
        reference.append_many([SeqAppend(seq, 0, head[seq]) for seq in range(N_SEQS)])
        expected = reference.append_many([SeqAppend(seq, 5, tail[seq]) for seq in range(N_SEQS)])
    assert max_difference(rows, expected) == 0.0


def test_save_and_restore_move_a_sequence_exactly(whole_model, sessions):
    streams, _ = sessions
    prompt, other = streams[0][0], streams[2][0]
    with BatchedShardContext(whole_model, N_CTX, N_SEQS, n_batch=N_BATCH) as source, \
            BatchedShardContext(whole_model, N_CTX, N_SEQS, n_batch=N_BATCH) as target:
        source.append_many([SeqAppend(1, 0, prompt), SeqAppend(2, 0, other)])
        blob = source.save_state(1)
        target.append_many([SeqAppend(0, 0, other)])
        assert target.restore_state(3, blob) == len(prompt)
        with pytest.raises(PositionMismatch):
            target.restore_state(0, blob)
        expected = source.append_many([SeqAppend(1, len(prompt), [42])])
        rows = target.append_many([SeqAppend(3, len(prompt), [42])])
        assert max_difference(rows, expected) == 0.0
        # a blob from a context with another number of streams is refused; the sequence stays empty
        with BatchedShardContext(whole_model, N_CTX, 2, n_batch=N_BATCH) as two:
            two.append_many([SeqAppend(0, 0, prompt)])
            foreign = two.save_state(0)
        with pytest.raises(BadInput):
            target.restore_state(1, foreign)
        assert target.lengths == (len(other), 0, 0, len(prompt) + 1)
        expected = source.append_many([SeqAppend(1, len(prompt) + 1, [43])])
        assert max_difference(target.append_many([SeqAppend(3, len(prompt) + 1, [43])]), expected) == 0.0


def test_close_is_idempotent_and_model_close_frees_batched_contexts(model_path):
    model = ShardModel(model_path)
    context = BatchedShardContext(model, 32, 2, n_batch=8)
    context.append_many([SeqAppend(1, 0, [1, 2, 3])])
    model.close()
    assert context.closed
    context.close()
    with pytest.raises(RuntimeError):
        context.append_many([SeqAppend(1, 3, [4])])

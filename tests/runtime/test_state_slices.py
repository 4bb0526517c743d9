"""Slices and joins of a sequence's llama.cpp state (kvpool.state.sequence: slice_state, cut_state,
join_states, check_cell_range), what the prefix store's delta entries are read from: on states built as
tests/support/fake_worker.py builds them (plain and transposed V, several layers and streams, cells in order
and out of it), the slice a cut takes and the mask give the same bytes, and slices joined in order are the
whole state byte for byte; on the real model, a saved 96-token state sliced at 64 and joined is the saved
state, and restored it continues bit for bit as the original does."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from kvpool.state import sequence
from kvpool.state.sequence import (
    CellRows,
    LayerKV,
    SequenceState,
    StateFormatError,
    Stream,
    TransposedRows,
    as_sequence,
    check_cell_range,
    check_cells,
    cut_state,
    join_states,
    parse_state,
    slice_state,
    write_state,
)
from workers.runtime.model import ShardModel

GGML_F32, GGML_F16 = 0, 1
ROW_BYTES = 32  # one sha256 digest per position, as tests/support/fake_worker.py writes K and V
LAYERS = 3


def _row(position: int, layer: int, kind: str) -> bytes:
    return hashlib.sha256(f"{kind}{layer}:{position}".encode()).digest()


def fake_state(positions: list[int], *, transposed: bool, streams: int = 1, seq_id: int = 0, stream: int = -1) -> bytes:
    """A state whose cells hold `positions` in that cache order, in stream `stream` of `streams` (the others
    empty; the last by default): K and V of position p are functions of p and the layer, so a state's bytes are a function of
    its positions and their order."""
    held = np.asarray(positions, np.int32)
    layers = []
    for layer in range(LAYERS):
        keys = np.frombuffer(b"".join(_row(int(p), layer, "K") for p in held), np.uint8).reshape(len(held), ROW_BYTES)
        values = np.frombuffer(b"".join(_row(int(p), layer, "V") for p in held), np.uint8).reshape(len(held), ROW_BYTES)
        if transposed:  # 16 columns of one f16 element per cell
            v = TransposedRows(GGML_F16, 2, ROW_BYTES // 2, np.ascontiguousarray(values.reshape(len(held), ROW_BYTES // 2, 2).transpose(1, 0, 2).reshape(ROW_BYTES // 2, -1)))
        else:
            v = CellRows(GGML_F32, ROW_BYTES, values.copy())
        layers.append(LayerKV(CellRows(GGML_F32, ROW_BYTES, keys.copy()), v))
    all_streams = [Stream(np.zeros(0, np.int32), (), False, ())] * streams
    all_streams[stream] = Stream(held, ((seq_id,),) * len(held), transposed, tuple(layers) if len(held) else ())
    return write_state(SequenceState(seq_id, tuple(all_streams)))


def _masked(state: SequenceState, start: int, stop: int) -> SequenceState:
    """slice_state by the boolean mask alone (the path a cut took before it took runs as slices)."""
    return SequenceState(state.seq_id, tuple(
        sequence._kept(stream, (stream.positions >= start) & (stream.positions < stop), as_run=False) for stream in state.streams
    ))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("streams", [1, 2])
def test_a_cut_takes_a_run_as_a_slice_and_gives_the_masks_bytes(transposed, streams):
    in_order = list(range(20))
    out_of_order = [0, 1, 2, 3, 4, 15, 16, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 17, 18, 19]  # a truncate at 5, then a re-append
    for positions in (in_order, out_of_order):
        state = parse_state(fake_state(positions, transposed=transposed, streams=streams))
        for start, stop in ((0, 0), (0, 1), (0, 5), (0, 12), (0, 16), (0, 19), (0, 20), (0, 10**6), (5, 17), (12, 20), (19, 20)):
            sliced = write_state(slice_state(state, start, stop))
            assert sliced == write_state(_masked(state, start, stop)), (positions is in_order, start, stop)
            kept = [position for position in positions if start <= position < stop]
            assert sliced == fake_state(kept, transposed=transposed, streams=streams)
            if start == 0:
                assert write_state(cut_state(state, stop)) == sliced


@pytest.mark.parametrize("transposed", [False, True])
def test_slices_joined_in_order_are_the_whole_state(transposed):
    whole = fake_state(list(range(24)), transposed=transposed, streams=2)
    state = parse_state(whole)
    for cuts in ((0, 8, 24), (0, 1, 23, 24), (0, 4, 8, 12, 16, 20, 24), (0, 0, 24, 24)):
        parts = [slice_state(state, a, b) for a, b in zip(cuts, cuts[1:])]
        assert write_state(join_states(parts)) == whole
    prefix = parse_state(fake_state(list(range(8)), transposed=transposed, streams=2))  # saved at 8, then sliced from a longer one
    for stop in range(9, 25):
        assert write_state(join_states([prefix, slice_state(state, 8, stop)])) == fake_state(list(range(stop)), transposed=transposed, streams=2)


@pytest.mark.parametrize("transposed", [False, True])
def test_states_two_sequences_saved_join_once_one_is_the_others(transposed):
    """Batched mode: each sequence keeps its own stream, and a state names its sequence in every cell."""
    mine = parse_state(fake_state(list(range(8)), transposed=transposed, streams=3, seq_id=0, stream=0))
    theirs = parse_state(fake_state(list(range(12)), transposed=transposed, streams=3, seq_id=2, stream=2))
    moved = as_sequence(slice_state(theirs, 8, 12), 0, 0)
    assert write_state(moved) == fake_state(list(range(8, 12)), transposed=transposed, streams=3, seq_id=0, stream=0)
    assert write_state(join_states([mine, moved])) == fake_state(list(range(12)), transposed=transposed, streams=3, seq_id=0, stream=0)
    with pytest.raises(StateFormatError):
        join_states([mine, slice_state(theirs, 8, 12)])  # another sequence's cells
    with pytest.raises(StateFormatError):
        as_sequence(theirs, 0, 3)
    two = SequenceState(0, (mine.streams[0], mine.streams[0]))
    with pytest.raises(StateFormatError):
        as_sequence(two, 0, 0)


def test_states_that_disagree_are_not_joined():
    plain, transposed = parse_state(fake_state(list(range(4)), transposed=False)), parse_state(fake_state(list(range(4, 8)), transposed=True))
    with pytest.raises(StateFormatError):
        join_states([plain, transposed])
    with pytest.raises(StateFormatError):
        join_states([plain, parse_state(fake_state(list(range(4, 8)), transposed=False, streams=2))])
    with pytest.raises(StateFormatError):
        join_states([plain, parse_state(fake_state(list(range(4, 8)), transposed=False, seq_id=1))])
    with pytest.raises(StateFormatError):
        join_states([])


def test_check_cell_range_passes_exactly_its_range():
    blob = fake_state([4, 5, 7, 6], transposed=True)
    check_cell_range(blob, 4, 8)
    for start, stop in ((0, 8), (4, 9), (5, 8), (4, 7), (3, 7)):
        with pytest.raises(StateFormatError, match="do not hold positions"):
            check_cell_range(blob, start, stop)
    with pytest.raises(StateFormatError, match="out of place"):
        check_cells(blob, 0)  # not a whole state
    check_cell_range(fake_state([], transposed=False), 0, 0)
    with pytest.raises(StateFormatError):
        check_cell_range(blob[:-1], 4, 8)


@pytest.mark.parametrize("transposed", [False, True])
def test_cells_of_several_sequences_are_read_one_at_a_time_and_written_back_byte_for_byte(transposed):
    """Cells of one sequence id each are read as one array of records and written as one; a state with a cell of
    several sequences (the first, one in the middle, the last) is read and written one cell at a time, and reads
    back as it was written."""
    state = parse_state(fake_state(list(range(6)), transposed=transposed))
    stream = state.streams[0]
    for several in (0, 3, 5):
        seq_ids = tuple((0, 1) if cell == several else ids for cell, ids in enumerate(stream.seq_ids))
        forged = write_state(SequenceState(state.seq_id, (dataclasses.replace(stream, seq_ids=seq_ids),)))
        again = parse_state(forged)
        assert again.streams[0].seq_ids == seq_ids
        assert again.streams[0].positions.tolist() == list(range(6))
        assert write_state(again) == forged
        with pytest.raises(StateFormatError, match="names 2 sequences"):
            check_cells(forged, 6)


def test_a_state_read_from_immutable_bytes_is_a_view_of_them_and_from_any_other_buffer_a_copy():
    """Parsing bytes copies none of their layers (the prefix store cuts its entries this way); a buffer its
    owner may change or unmap is copied, so the state stays what was read."""
    blob = fake_state(list(range(4)), transposed=True)
    viewed = parse_state(blob).streams[0].layers[0]
    assert not viewed.k.data.flags.writeable and np.shares_memory(viewed.k.data, np.frombuffer(blob, np.uint8))
    changing = bytearray(blob)
    state = parse_state(changing)
    changing[:] = bytes(len(changing))
    assert write_state(state) == blob
    assert write_state(parse_state(memoryview(blob).toreadonly()[:])) == blob


# ---- the real model ------------------------------------------------------------------------------------------


def test_a_saved_state_sliced_and_joined_is_the_saved_state_and_restores_bit_for_bit(model_path, prompt_ids):
    tokens = (prompt_ids[1] * (96 // len(prompt_ids[1]) + 1))[:96]
    with ShardModel(model_path) as model:
        with model.new_context(128) as original:
            original.append(0, tokens=np.asarray(tokens, np.int32))
            blob = original.save_state()
            expected = original.append(96, tokens=np.asarray([42], np.int32))
        state = parse_state(blob)
        head, tail = slice_state(state, 0, 64), slice_state(state, 64, 96)
        check_cell_range(write_state(tail), 64, 96)
        assert check_cells(write_state(head), 64) == 64
        joined = write_state(join_states([head, tail]))
        assert joined == blob
        with model.new_context(128) as restored:
            assert restored.restore_state(joined, 96) == 96
            got = restored.append(96, tokens=np.asarray([42], np.int32))
        assert np.array_equal(got, expected)  # bit for bit


def test_a_batched_sequences_state_joined_as_another_sequences_restores_bit_for_bit(model_path):
    """Batched mode keeps a stream per sequence (kv_unified off): sequence 2's state holds its cells in stream
    2. Its slices, made sequence 0's in stream 0 and joined, restore into sequence 1 of a fresh context and
    continue as sequence 2 does."""
    from workers.runtime.batched import BatchedShardContext, SeqAppend

    ids = np.arange(100, 196, dtype=np.int32)
    with ShardModel(model_path) as model:
        with BatchedShardContext(model, 256, 3, n_batch=256) as context:
            context.append_many([SeqAppend(2, 0, ids)])
            blob = context.save_state(2)
            expected = context.append_many([SeqAppend(2, 96, np.asarray([42], np.int32))])[0]
        state = parse_state(blob)
        assert [stream.n_cells for stream in state.streams] == [0, 0, 96]
        assert write_state(join_states([as_sequence(slice_state(state, 0, 64), 2, 2), slice_state(state, 64, 96)])) == blob
        joined = write_state(join_states([as_sequence(slice_state(state, 0, 64), 0, 0), as_sequence(slice_state(state, 64, 96), 0, 0)]))
        assert check_cells(joined, 96) == 96
        with BatchedShardContext(model, 256, 3, n_batch=256) as context:
            assert context.restore_state(1, joined) == 96
            got = context.append_many([SeqAppend(1, 96, np.asarray([42], np.int32))])[0]
        assert np.array_equal(got, expected)

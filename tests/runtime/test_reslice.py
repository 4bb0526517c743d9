"""kvpool.state: a sequence state read into cells and per-layer K/V and written back byte for byte, and the
states of one split's shards re-sliced into another split's, which restore and continue bit-exactly.

The re-plans run on the bundled model, both V layouts (flash attention off: V transposed; on: plain): a prompt
is prefilled on the source split, each shard's state saved, re-sliced for the target split and restored there;
the next greedy appends give the same logits, bit for bit, as the source session that never moved, and the
re-sliced bytes equal those the target split's own prefill saves.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvpool.local.chain import LocalChain
from kvpool.shard.header import ShardInfo, read_shard_info
from kvpool.shard.ranges import parse_splits
from kvpool.shard.writer import write_shards
from kvpool.state.reslice import ResliceError, ShardState, reslice, reslice_bytes
from kvpool.state.sequence import (
    STATE_MAGIC,
    CellRows,
    LayerKV,
    SequenceState,
    StateFormatError,
    Stream,
    TransposedRows,
    cut_state,
    parse_state,
    write_state,
)
from tests.conftest import EVEN_SPLIT, TOTAL_LAYERS

N_CTX = 128
APPENDS = 4
F16 = 1  # ggml type ids
Q4_0 = 2
ROW_BYTES = 384  # SmolLM2-135M: 3 KV heads x 64 values x 2 bytes (F16)
SPLITS = {
    "even": EVEN_SPLIT,
    "two": "0:14,14:30",
    "fine": "0:5,5:20,20:30",
    "four": "0:4,4:12,12:21,21:30",
    "whole": "0:30",
}
REPLANS = [("even", "two"), ("fine", "whole"), ("even", "four"), ("whole", "even"), ("even", "even")]


@pytest.fixture(scope="module")
def routes(model_path, shard_sets, tmp_path_factory) -> dict[str, list[ShardInfo]]:
    root = tmp_path_factory.mktemp("reslice")
    routes = {"even": shard_sets[EVEN_SPLIT], "whole": [read_shard_info(model_path)]}
    for name in ("two", "fine", "four"):
        routes[name] = write_shards(model_path, parse_splits(SPLITS[name], TOTAL_LAYERS), root / name)
    return routes


def _paths(route: list[ShardInfo]) -> list:
    return [info.path for info in route]


def _shard_states(route: list[ShardInfo], blobs: list[bytes]) -> list[ShardState]:
    return [
        ShardState.from_bytes(info.shape.layer_start, info.shape.layer_stop, info.lookahead_layers, blob)
        for info, blob in zip(route, blobs, strict=True)
    ]


def _resliced(inputs: list[ShardState], route: list[ShardInfo]) -> list[bytes]:
    return [reslice_bytes(inputs, info.shape.layer_start, info.shape.layer_stop, info.lookahead_layers) for info in route]


def _greedy_appends(session, start: int, logits: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    """APPENDS one-token greedy appends after `logits`: the tokens and the logits each gave."""
    tokens, rows = [], []
    for offset in range(APPENDS):
        tokens.append(int(np.argmax(logits[-1])))
        logits = session.append(start + offset, tokens[-1:])
        rows.append(logits.copy())
    return tokens, rows


# ---- re-plans on the bundled model ------------------------------------------------------------------------


@pytest.mark.parametrize("flash_attn", [False, True], ids=["v-transposed", "v-plain"])
@pytest.mark.parametrize(("source", "target"), REPLANS, ids=[f"{s}-to-{t}" for s, t in REPLANS])
def test_a_resliced_session_continues_bit_exactly(routes, prompt_ids, source, target, flash_attn):
    prompt = prompt_ids[1]
    with LocalChain(_paths(routes[source]), flash_attn=flash_attn) as chain, chain.new_session(N_CTX) as unmoved:
        prefill_logits = unmoved.append(0, prompt)
        saved = [context.save_state() for context in unmoved.contexts]
        tokens, expected = _greedy_appends(unmoved, len(prompt), prefill_logits)
    moved = _resliced(_shard_states(routes[source], saved), routes[target])

    with LocalChain(_paths(routes[target]), flash_attn=flash_attn) as chain:
        with chain.new_session(N_CTX) as restored:
            for context, blob in zip(restored.contexts, moved, strict=True):
                assert context.restore_state(blob, len(prompt)) == len(prompt)
            got = [restored.append(len(prompt) + offset, [token]).copy() for offset, token in enumerate(tokens)]
        for step, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
            assert np.array_equal(mine, theirs), f"append {step}: max |Δ| = {np.abs(mine - theirs).max()}"
        with chain.new_session(N_CTX) as prefilled_there:
            prefilled_there.append(0, prompt)
            assert [context.save_state() for context in prefilled_there.contexts] == moved


def test_a_whole_model_state_has_no_lookahead_layer(routes, prompt_ids):
    with LocalChain(_paths(routes["whole"])) as chain, chain.new_session(N_CTX) as session:
        session.append(0, prompt_ids[0])
        state = parse_state(session.contexts[0].save_state())
    assert routes["whole"][0].lookahead_layers == 0
    assert state.n_layers == TOTAL_LAYERS


# ---- the even split's states: the format and the refusals -----------------------------------------------


@pytest.fixture(scope="module")
def even_states(routes, prompt_ids) -> dict[str, list[bytes]]:
    """The even split's states after the prompt ("plain" with flash attention), and one token later ("longer")."""
    prompt = prompt_ids[0]
    states = {}
    for flash_attn, name in ((False, "transposed"), (True, "plain")):
        with LocalChain(_paths(routes["even"]), flash_attn=flash_attn) as chain, chain.new_session(N_CTX) as session:
            session.append(0, prompt)
            states[name] = [context.save_state() for context in session.contexts]
            session.append(len(prompt), [42])
            states["longer" if not flash_attn else "plain-longer"] = [context.save_state() for context in session.contexts]
    return states


@pytest.mark.parametrize("layout", ["transposed", "plain"])
def test_a_state_cut_to_a_length_is_the_state_saved_at_that_length(even_states, prompt_ids, layout):
    """cut_state drops the cells past a length with their K rows and V elements (what a truncate of a parked
    session leaves behind its header): the prompt + one token state cut to the prompt is, byte for byte,
    the state saved after the prompt; cut to 0 it holds no cells, cut past its end it is unchanged."""
    longer = even_states["longer" if layout == "transposed" else "plain-longer"]
    for blob, shorter in zip(longer, even_states[layout], strict=True):
        state = parse_state(blob)
        assert write_state(cut_state(state, len(prompt_ids[0]))) == shorter
        assert write_state(cut_state(state, len(prompt_ids[0]) + 1)) == blob == write_state(cut_state(state, 10**6))
        assert [stream.n_cells for stream in cut_state(state, 0).streams] == [0]


@pytest.mark.parametrize("layout", ["transposed", "plain"])
def test_llama_cpp_states_parse_and_write_back_byte_exactly(even_states, prompt_ids, layout):
    for index, blob in enumerate(even_states[layout]):
        state = parse_state(blob)
        assert write_state(state) == blob
        (stream,) = state.streams
        assert state.seq_id == 0
        assert np.array_equal(stream.positions, np.arange(len(prompt_ids[0])))
        assert stream.seq_ids == ((0,),) * len(prompt_ids[0])
        assert stream.v_transposed == (layout == "transposed")
        assert len(stream.layers) == (11 if index == 0 else 10)  # the first shard's lookahead layer counts
        for layer in stream.layers:
            assert (layer.k.ggml_type, layer.k.row_bytes, layer.k.data.shape) == (F16, ROW_BYTES, (stream.n_cells, ROW_BYTES))
            assert layer.v.ggml_type == F16
            assert isinstance(layer.v, TransposedRows if layout == "transposed" else CellRows)


def test_the_lookahead_layer_is_never_written(even_states):
    """What re-slicing fills a new first shard's lookahead layer with: zeros, as the graph stops before it."""
    layers = parse_state(even_states["transposed"][0]).streams[0].layers
    assert not layers[10].k.data.any() and not layers[10].v.data.any()
    assert layers[9].k.data.any() and layers[9].v.data.any()


def _even_inputs(even_states, routes, name="transposed") -> list[ShardState]:
    return _shard_states(routes["even"], even_states[name])


def test_the_same_split_reslices_to_the_same_bytes(even_states, routes):
    inputs = _even_inputs(even_states, routes)
    assert _resliced(inputs, routes["even"]) == even_states["transposed"]
    # a shard's own state alone is enough for itself: its lookahead widths are its own lookahead layer's
    assert reslice_bytes(inputs[:1], 0, 10, 1) == even_states["transposed"][0]


def test_a_target_at_the_edge_of_the_inputs(even_states, routes):
    middle = _even_inputs(even_states, routes)[1:2]
    assert reslice_bytes(middle, 10, 20) == even_states["transposed"][1]
    with pytest.raises(ResliceError, match="layers 20:21 of 10:21 are in no input"):
        reslice(middle, 10, 21)
    with pytest.raises(ResliceError, match="layers 9:10 of 9:20 are in no input"):
        reslice(middle, 9, 20)
    with pytest.raises(ResliceError, match="lookahead layers 20:21"):
        reslice(middle, 10, 20, 1)
    _, middle_, last = _even_inputs(even_states, routes)
    assert reslice([middle_, last], 10, 20, 1).n_layers == 11  # layer 20's widths: the last shard's layer 20


def test_inputs_that_leave_a_gap_or_overlap_are_refused(even_states, routes):
    first, middle, last = _even_inputs(even_states, routes)
    with pytest.raises(ResliceError, match="layers 10:20 of 0:30 are in no input"):
        reslice([first, last], 0, 30)
    with pytest.raises(ResliceError, match="layer 0 is in two input states"):
        reslice([first, first, middle, last], 0, 30)
    with pytest.raises(ResliceError, match="no input states"):
        reslice([], 0, 30)


def test_inputs_that_disagree_on_cells_or_v_layout_are_refused(even_states, routes):
    first, middle, last = _even_inputs(even_states, routes)
    longer = _even_inputs(even_states, routes, "longer")
    with pytest.raises(ResliceError, match="disagree on the cells"):
        reslice([first, longer[1], last], 0, 14, 1)
    plain = _even_inputs(even_states, routes, "plain")
    with pytest.raises(ResliceError, match="disagree on the cells"):
        reslice([first, plain[1], last], 0, 30)


def test_a_state_whose_layer_count_is_not_its_range_is_refused(even_states):
    state = parse_state(even_states["transposed"][0])  # 10 layers + 1 lookahead
    with pytest.raises(ResliceError, match="holds 11 layers, 10 expected"):
        ShardState(0, 10, 0, state)
    for start, stop, lookahead in ((5, 5, 0), (-1, 10, 1), (0, 10, -1)):
        with pytest.raises(ResliceError, match="bad layer range"):
            ShardState(start, stop, lookahead, state)
    with pytest.raises(ResliceError, match="bad layer range"):
        reslice([ShardState(0, 10, 1, state)], 3, 2)


# ---- the format's refusals and fuzzing ----------------------------------------------------------------------


def _synthetic(*, transposed: bool) -> bytes:
    """A small state of two streams (3 cells, then none), 2 layers of F16, a cell in two sequences."""
    rng = np.random.default_rng(7)

    def v_rows():
        if transposed:
            return TransposedRows(F16, 2, 4, rng.integers(0, 256, (4, 3 * 2), dtype=np.uint8))
        return CellRows(F16, 8, rng.integers(0, 256, (3, 8), dtype=np.uint8))

    layers = tuple(LayerKV(CellRows(F16, 8, rng.integers(0, 256, (3, 8), dtype=np.uint8)), v_rows()) for _ in range(2))
    cells = Stream(np.array([0, 1, 5], np.int32), ((0,), (0, 1), (1,)), transposed, layers)
    empty = Stream(np.zeros(0, np.int32), (), False, ())
    return write_state(SequenceState(3, (cells, empty)))


@pytest.mark.parametrize("transposed", [False, True])
def test_every_truncation_of_a_state_is_a_format_error(transposed):
    blob = _synthetic(transposed=transposed)
    assert write_state(parse_state(blob)) == blob
    for length in range(len(blob)):
        with pytest.raises(StateFormatError):
            parse_state(blob[:length])


@pytest.mark.parametrize("transposed", [False, True])
def test_every_bit_flip_is_a_format_error_or_writes_back(transposed):
    blob = _synthetic(transposed=transposed)
    parsed = 0
    for bit in range(len(blob) * 8):
        flipped = bytearray(blob)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            state = parse_state(bytes(flipped))
        except StateFormatError:
            continue
        assert write_state(state) == flipped
        parsed += 1
    assert 0 < parsed < len(blob) * 8  # the data bytes parse, most header bits do not


def test_random_cuts_and_flips_of_a_real_state(even_states):
    blob = even_states["transposed"][1]
    rng = np.random.default_rng(0)
    header_end = 12 + 12 * len(parse_state(blob).streams[0].positions) + 8 + 12  # through the first K header
    for _ in range(200):
        with pytest.raises(StateFormatError):
            parse_state(blob[: int(rng.integers(0, len(blob)))])
    for _ in range(300):
        flipped = bytearray(blob)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, header_end if rng.random() < 0.7 else len(blob)))
            flipped[at] ^= 1 << int(rng.integers(0, 8))
        try:
            state = parse_state(bytes(flipped))
        except StateFormatError:
            continue
        assert write_state(state) == flipped


def _header(*, magic=STATE_MAGIC, n_stream=1, n_cells=1) -> bytes:
    return struct.pack("<IiII", magic, 0, n_stream, n_cells) + struct.pack("<iIi", 0, 1, 0)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "truncated"),
        (_header(magic=0x67677371) + b"\0" * 64, "not a sequence state"),
        (_header() + struct.pack("<II", 2, 1) + b"\0" * 64, "V transposition flag 2"),
        (_header() + struct.pack("<II", 0, 1) + struct.pack("<iQ", 999, 8) + b"\0" * 64, "unknown ggml type 999"),
        (_header() + struct.pack("<II", 0, 1) + struct.pack("<iQ", Q4_0, 10) + b"\0" * 64, "not whole blocks"),
        (_header() + struct.pack("<II", 0, 1) + struct.pack("<iQ", F16, 0) + b"\0" * 64, "not whole blocks"),
        (_header() + struct.pack("<II", 1, 1) + struct.pack("<iQ", F16, 2) + b"\0\0" + struct.pack("<iII", Q4_0, 18, 1) + b"\0" * 18, "transposed V"),
        (_header() + struct.pack("<II", 0, 1000) + b"\0" * 64, "1000 layers announced"),
        (struct.pack("<IiII", STATE_MAGIC, 0, 1, 2**32 - 1), "4294967295 cells announced"),
        (struct.pack("<IiI", STATE_MAGIC, 0, 2**32 - 1) + struct.pack("<I", 0), "4294967295 streams announced, 1 present"),
        (struct.pack("<IiII", STATE_MAGIC, 0, 1, 0) + b"\0", "1 bytes after the last stream"),
    ],
    ids=["empty", "magic", "v-flag", "ggml-type", "row-blocks", "row-zero", "transposed-block-type", "layers", "cells", "streams", "trailing"],
)
def test_malformed_states_are_refused_with_a_typed_error(blob, message):
    with pytest.raises(StateFormatError, match=message):
        parse_state(blob)


def test_a_state_with_no_cells_writes_back_and_reslices_to_no_cells():
    blob = struct.pack("<IiII", STATE_MAGIC, 0, 1, 0)
    state = parse_state(blob)
    assert write_state(state) == blob and state.n_layers is None
    assert reslice_bytes([ShardState(0, 10, 1, state), ShardState(10, 30, 0, state)], 0, 30) == blob


def test_rows_that_do_not_fit_their_header_are_not_written():
    state = parse_state(_synthetic(transposed=False))
    layer = state.streams[0].layers[0]
    short = LayerKV(CellRows(F16, 8, layer.k.data[:2]), layer.v)
    broken = Stream(state.streams[0].positions, state.streams[0].seq_ids, False, (short,) + state.streams[0].layers[1:])
    with pytest.raises(StateFormatError, match="expected uint8"):
        write_state(SequenceState(3, (broken,)))


def test_quantized_rows_reslice_layer_by_layer():
    """Any whole-block ggml type re-slices as bytes: K in Q8_0 (34-byte blocks), V in Q4_0 (18-byte blocks)."""
    rng = np.random.default_rng(3)
    positions, seq_ids = np.arange(4, dtype=np.int32), ((0,),) * 4

    def layer(mark):
        k = np.full((4, 68), mark, np.uint8)
        return LayerKV(CellRows(8, 68, k), CellRows(Q4_0, 36, rng.integers(0, 256, (4, 36), dtype=np.uint8)))

    def shard(start, stop, lookahead):
        layers = tuple(layer(index) for index in range(start, stop + lookahead))
        return ShardState(start, stop, lookahead, SequenceState(0, (Stream(positions, seq_ids, False, layers),)))

    inputs = [shard(0, 3, 1), shard(3, 5, 0), shard(5, 6, 0)]
    for blob in (write_state(shard_.state) for shard_ in inputs):
        assert write_state(parse_state(blob)) == blob
    layers = reslice(inputs, 0, 4, 1).streams[0].layers
    assert [int(kv.k.data[0, 0]) for kv in layers] == [0, 1, 2, 3, 0]  # layer 3 from the second input, then zeros
    assert not layers[4].v.data.any() and (layers[4].k.ggml_type, layers[4].v.row_bytes) == (8, 36)
    assert np.array_equal(layers[3].v.data, inputs[1].state.streams[0].layers[0].v.data)
    assert parse_state(reslice_bytes(inputs, 2, 6)).n_layers == 4

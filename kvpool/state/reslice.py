"""Re-slicing: the sequence states of shards that covered layers [a, b) of one source model, assembled into
the state of a shard [c, d) with a <= c < d <= b, cut anywhere (kvpool.state.sequence reads and writes them).

A shard's state holds one layer per local layer, source layers [start, stop), then its lookahead layers
(source layers [stop, stop + lookahead), which llama.cpp allocates KV for and kvpool never runs: the graph
stops after the shard's last local layer, so their cells keep what the context was created with, zeros).
Layer i of the result is layer i of whichever input covers it, byte for byte; a lookahead layer of the result
is zeros in the K/V type and widths of that source layer, taken from an input that covers it (or holds it as
its own lookahead layer). Inputs must agree on their cells: the same streams, positions and sequence ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvpool.state.sequence import CellRows, LayerKV, SequenceState, Stream, TransposedRows, parse_state, write_state


class ResliceError(ValueError):
    """The inputs cannot make the requested shard's state: ranges that overlap or leave the target uncovered,
    a state whose layer count is not its range's, or states that disagree on their cells or V layout."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardState:
    """A shard's sequence state with where its layers sit in the source model: [layer_start, layer_stop)
    computed, then `lookahead_layers` never run (kvpool.shard.contents: one on the first shard of a split)."""

    layer_start: int
    layer_stop: int
    lookahead_layers: int
    state: SequenceState

    def __post_init__(self) -> None:
        _check_range(self.layer_start, self.layer_stop, self.lookahead_layers)
        expected = self.layer_stop - self.layer_start + self.lookahead_layers
        if self.state.n_layers not in (None, expected):
            raise ResliceError(
                f"the state of layers {self.layer_start}:{self.layer_stop} (+{self.lookahead_layers} lookahead) "
                f"holds {self.state.n_layers} layers, {expected} expected"
            )

    @classmethod
    def from_bytes(cls, layer_start: int, layer_stop: int, lookahead_layers: int, blob: bytes) -> ShardState:
        return cls(layer_start, layer_stop, lookahead_layers, parse_state(blob))


def reslice(inputs: Sequence[ShardState], layer_start: int, layer_stop: int, lookahead_layers: int = 0) -> SequenceState:
    """The state of the shard [layer_start, layer_stop) with `lookahead_layers`, from `inputs`."""
    _check_range(layer_start, layer_stop, lookahead_layers)
    if not inputs:
        raise ResliceError("no input states")
    _check_same_cells(inputs)
    owners = _layer_owners(inputs)
    missing = [layer for layer in range(layer_start, layer_stop) if layer not in owners]
    if missing:
        raise ResliceError(f"layers {_ranges_text(missing)} of {layer_start}:{layer_stop} are in no input state")
    lookahead = range(layer_stop, layer_stop + lookahead_layers)
    templates = _lookahead_templates(inputs, owners)
    unknown = [layer for layer in lookahead if layer not in templates]
    if unknown:
        raise ResliceError(f"the K/V widths of lookahead layers {_ranges_text(unknown)} are in no input state")
    first = inputs[0].state
    streams = []
    for index, stream in enumerate(first.streams):
        if not stream.n_cells:
            streams.append(stream)
            continue
        layers = [_layer(owners[layer], index) for layer in range(layer_start, layer_stop)]
        layers += [_zeros(_layer(templates[layer], index)) for layer in lookahead]
        streams.append(dataclasses.replace(stream, layers=tuple(layers)))
    return SequenceState(first.seq_id, tuple(streams))


def reslice_bytes(inputs: Sequence[ShardState], layer_start: int, layer_stop: int, lookahead_layers: int = 0) -> bytes:
    """reslice, written as llama_state_seq_set_data takes it."""
    return write_state(reslice(inputs, layer_start, layer_stop, lookahead_layers))


# A layer of an input: (the input, its local layer index).
_Slot = tuple[ShardState, int]


def _check_range(start: int, stop: int, lookahead: int) -> None:
    if start < 0 or stop <= start or lookahead < 0:
        raise ResliceError(f"bad layer range {start}:{stop} with {lookahead} lookahead layers")


def _check_same_cells(inputs: Sequence[ShardState]) -> None:
    first = inputs[0].state
    for other in inputs[1:]:
        state = other.state
        if state.seq_id != first.seq_id or len(state.streams) != len(first.streams):
            raise ResliceError("input states disagree on their sequence id or stream count")
        for index, (mine, theirs) in enumerate(zip(first.streams, state.streams)):
            if not _same_cells(mine, theirs):
                raise ResliceError(
                    f"input states disagree on the cells of stream {index} "
                    f"(layers {inputs[0].layer_start}:{inputs[0].layer_stop} and {other.layer_start}:{other.layer_stop})"
                )


def _same_cells(a: Stream, b: Stream) -> bool:
    return (
        np.array_equal(a.positions, b.positions)
        and a.seq_ids == b.seq_ids
        and (not a.n_cells or a.v_transposed == b.v_transposed)
    )


def _layer_owners(inputs: Sequence[ShardState]) -> dict[int, _Slot]:
    """Each source layer an input computed, with where it sits; a layer two inputs hold is refused."""
    owners: dict[int, _Slot] = {}
    for shard in inputs:
        for layer in range(shard.layer_start, shard.layer_stop):
            if layer in owners:
                held = owners[layer][0]
                raise ResliceError(
                    f"layer {layer} is in two input states: {held.layer_start}:{held.layer_stop} and {shard.layer_start}:{shard.layer_stop}"
                )
            owners[layer] = (shard, layer - shard.layer_start)
    return owners


def _lookahead_templates(inputs: Sequence[ShardState], owners: dict[int, _Slot]) -> dict[int, _Slot]:
    """Where a source layer's K/V type and widths can be read: a computed layer, or an input's lookahead layer."""
    templates = dict(owners)
    for shard in inputs:
        n_local = shard.layer_stop - shard.layer_start
        for offset in range(shard.lookahead_layers):
            templates.setdefault(shard.layer_stop + offset, (shard, n_local + offset))
    return templates


def _layer(slot: _Slot, stream: int) -> LayerKV:
    shard, local = slot
    return shard.state.streams[stream].layers[local]


def _zeros(layer: LayerKV) -> LayerKV:
    return LayerKV(_zero_rows(layer.k), _zero_rows(layer.v))


def _zero_rows(rows: CellRows | TransposedRows) -> CellRows | TransposedRows:
    return dataclasses.replace(rows, data=np.zeros_like(rows.data))


def _ranges_text(layers: list[int]) -> str:
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1])
    return ",".join(f"{start}:{stop}" for start, stop in runs)

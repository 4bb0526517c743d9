"""A sequence's llama.cpp state (llama_state_seq_get_data) read into cells and per-layer K/V, and written back
byte for byte.

The layout, as llama-cpp-python 0.3.36's llama.cpp writes it (llama_context::state_seq_get_data, then
llama_kv_cache::state_write / state_write_meta / state_write_data), all little-endian:

    u32 magic 0xAF143CD8, i32 seq_id                      the context's preamble
    u32 n_stream
    per stream:  u32 n_cells                              a stream with no cells ends here
                 per cell:  i32 pos, u32 n_seq, n_seq x i32 seq_id
                 u32 v_trans, u32 n_layer
                 per layer: i32 k_type, u64 k_row_bytes, n_cells x k_row_bytes
                 per layer, V plain:      i32 v_type, u64 v_row_bytes, n_cells x v_row_bytes
                 per layer, V transposed: i32 v_type, u32 v_element_bytes, u32 v_width,
                                          v_width x (n_cells x v_element_bytes)

Supported: models whose cells carry no position extension (llama.cpp writes one only when a position has
several dimensions, M-RoPE) and whose every layer has a V cache; a state without those is refused.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import gguf
import numpy as np

STATE_MAGIC = 0xAF143CD8
_ONE_SEQ_CELL = struct.Struct("<iIi")  # a cell of one sequence id: pos, n_seq (1), seq_id


class StateFormatError(ValueError):
    """The bytes are not a sequence state of the layout above: truncated, inconsistent or trailing bytes."""


@dataclasses.dataclass(frozen=True, slots=True)
class CellRows:
    """One layer's K (or plain V) for a stream's cells: one row of `row_bytes` per cell, uint8 [cells, row_bytes]."""

    ggml_type: int
    row_bytes: int
    data: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class TransposedRows:
    """One layer's V stored transposed (llama.cpp without flash attention): `width` rows of one element per
    cell, uint8 [width, cells * element_bytes]."""

    ggml_type: int
    element_bytes: int
    width: int
    data: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class LayerKV:
    k: CellRows
    v: CellRows | TransposedRows


@dataclasses.dataclass(frozen=True, slots=True)
class Stream:
    """One KV stream's cells in cache order: positions int32 [cells], the sequence ids of each cell, and
    every layer's K and V for them (none when the stream has no cells)."""

    positions: np.ndarray
    seq_ids: tuple[tuple[int, ...], ...]
    v_transposed: bool
    layers: tuple[LayerKV, ...]

    @property
    def n_cells(self) -> int:
        return len(self.positions)


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceState:
    seq_id: int
    streams: tuple[Stream, ...]

    @property
    def n_layers(self) -> int | None:
        """The layer count of its streams with cells (they agree), None when no stream has cells."""
        counts = {len(stream.layers) for stream in self.streams if stream.n_cells}
        return counts.pop() if counts else None


def cut_state(state: SequenceState, length: int) -> SequenceState:
    """The state holding only positions [0, length), as llama.cpp's seq_rm(seq, length, -1) leaves it: every
    cell at a later position dropped with its K rows and V elements, the others in their order. A daemon
    truncates a parked session by its header's length alone (kvpool.state.header), so its bytes may hold more."""
    return slice_state(state, 0, length)


def slice_state(state: SequenceState, start: int, stop: int) -> SequenceState:
    """The state holding only the cells of positions [start, stop), in their order, with their K rows and V
    elements (cut_state is the slice from 0)."""
    return SequenceState(state.seq_id, tuple(_kept(stream, (stream.positions >= start) & (stream.positions < stop)) for stream in state.streams))


def _kept(stream: Stream, keep: np.ndarray, *, as_run: bool = True) -> Stream:
    """The stream's cells where `keep` is true. Kept cells that are one run of the stream's cells (positions
    in cache order: the usual case) are taken as a slice, one copy of contiguous bytes per layer; others by
    the mask (`as_run=False` forces the mask: both give the same bytes)."""
    count = int(np.count_nonzero(keep))
    if count == len(keep):
        return stream
    if not count:
        return Stream(np.zeros(0, np.int32), (), False, ())
    first = int(np.argmax(keep))
    if as_run and keep[first : first + count].all():
        run = slice(first, first + count)
        layers = tuple(LayerKV(_run_rows(layer.k, run, len(keep)), _run_rows(layer.v, run, len(keep))) for layer in stream.layers)
        return Stream(stream.positions[run].copy(), stream.seq_ids[run], stream.v_transposed, layers)
    layers = tuple(LayerKV(_cut_rows(layer.k, keep), _cut_rows(layer.v, keep)) for layer in stream.layers)
    seq_ids = tuple(ids for ids, kept in zip(stream.seq_ids, keep) if kept)
    return Stream(stream.positions[keep], seq_ids, stream.v_transposed, layers)


def _run_rows(rows: CellRows | TransposedRows, run: slice, n_cells: int) -> CellRows | TransposedRows:
    if isinstance(rows, CellRows):
        return dataclasses.replace(rows, data=np.ascontiguousarray(rows.data[run]))
    columns = slice(run.start * rows.element_bytes, run.stop * rows.element_bytes)
    return dataclasses.replace(rows, data=np.ascontiguousarray(rows.data[:, columns]))


def _cut_rows(rows: CellRows | TransposedRows, keep: np.ndarray) -> CellRows | TransposedRows:
    if isinstance(rows, CellRows):
        return dataclasses.replace(rows, data=np.ascontiguousarray(rows.data[keep]))
    elements = rows.data.reshape(rows.width, len(keep), rows.element_bytes)[:, keep, :]
    return dataclasses.replace(rows, data=np.ascontiguousarray(elements.reshape(rows.width, -1)))


def as_sequence(state: SequenceState, seq_id: int, stream: int) -> SequenceState:
    """A one-sequence state's cells as sequence `seq_id`'s, in stream `stream` (the state's other streams
    empty): its preamble's and every cell's sequence id rewritten. llama.cpp reads such a state into whichever
    sequence it is asked to, each stream with cells into that sequence's stream, and discards the ids the
    cells name; a context whose sequences keep streams of their own (kv_unified off) saves a sequence's cells
    in its own stream. So states saved by two sequences join (join_states) once one is the other's. A
    StateFormatError when more than one stream holds cells or `stream` is not one of the state's."""
    held = [one for one in state.streams if one.n_cells]
    if len(held) > 1 or not 0 <= stream < len(state.streams):
        raise StateFormatError(f"a state of {len(held)} streams with cells made stream {stream} of {len(state.streams)}")
    streams = [Stream(np.zeros(0, np.int32), (), False, ())] * len(state.streams)
    if held:
        streams[stream] = dataclasses.replace(held[0], seq_ids=((seq_id,),) * held[0].n_cells)
    return SequenceState(seq_id, tuple(streams))


def join_states(states: list[SequenceState]) -> SequenceState:
    """The states of one sequence (each holding its own positions, earlier ones first) as one: stream by
    stream their cells in that order, layer by layer their K rows and V rows (or transposed V columns) side by
    side. The slices of a state joined in order are that state, byte for byte (write_state). Streams and layers
    that disagree (count, V layout, ggml type, row size, V width) are a StateFormatError."""
    if not states:
        raise StateFormatError("no state to join")
    seq_id, n_streams = states[0].seq_id, len(states[0].streams)
    if any(state.seq_id != seq_id or len(state.streams) != n_streams for state in states):
        raise StateFormatError("the states to join are of other sequences or stream counts")
    return SequenceState(seq_id, tuple(_join_streams([state.streams[index] for state in states]) for index in range(n_streams)))


def _join_streams(streams: list[Stream]) -> Stream:
    held = [stream for stream in streams if stream.n_cells]
    if len(held) < 2:
        return held[0] if held else streams[0]
    first = held[0]
    if any(stream.v_transposed != first.v_transposed or len(stream.layers) != len(first.layers) for stream in held):
        raise StateFormatError("the streams to join disagree on their V layout or layer count")
    layers = tuple(
        LayerKV(_join_rows([stream.layers[index].k for stream in held]), _join_rows([stream.layers[index].v for stream in held]))
        for index in range(len(first.layers))
    )
    positions = np.concatenate([stream.positions for stream in held]).astype(np.int32, copy=False)
    return Stream(positions, tuple(ids for stream in held for ids in stream.seq_ids), first.v_transposed, layers)


def _join_rows(parts: list) -> CellRows | TransposedRows:
    first = parts[0]
    if isinstance(first, CellRows):
        if any(not isinstance(part, CellRows) or (part.ggml_type, part.row_bytes) != (first.ggml_type, first.row_bytes) for part in parts):
            raise StateFormatError("the layers to join disagree on their ggml type or row size")
        return dataclasses.replace(first, data=np.concatenate([part.data for part in parts], axis=0))
    if any(not isinstance(part, TransposedRows) or (part.ggml_type, part.element_bytes, part.width) != (first.ggml_type, first.element_bytes, first.width) for part in parts):
        raise StateFormatError("the transposed V to join disagrees on its ggml type, element size or width")
    return dataclasses.replace(first, data=np.concatenate([part.data for part in parts], axis=1))


# ---- reading ------------------------------------------------------------------------------------------------


class _Reader:
    """Bounds-checked reads from the state's bytes: every read past the end is a StateFormatError."""

    def __init__(self, blob: bytes) -> None:
        self._view = memoryview(blob)
        self.offset = 0
        # arrays read from immutable bytes are views that keep those bytes alive; from any other buffer (a mapping
        # its owner may close, a bytearray it may change) they are copies
        self._immutable = isinstance(self._view.obj, bytes)

    def remaining(self) -> int:
        return len(self._view) - self.offset

    def take(self, size: int, what: str) -> memoryview:
        if size < 0 or size > self.remaining():
            raise StateFormatError(f"truncated state: {what} needs {size} bytes at offset {self.offset}, {self.remaining()} left")
        chunk = self._view[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def peek(self, size: int) -> memoryview | None:
        """The next `size` bytes without reading past them (None: fewer are left)."""
        return self._view[self.offset : self.offset + size] if 0 <= size <= self.remaining() else None

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def array(self, shape: tuple[int, ...], what: str) -> np.ndarray:
        """uint8 `shape`: a read-only view of immutable bytes, else a copy."""
        size = math.prod(shape)  # Python ints: a u64 row size cannot wrap
        data = np.frombuffer(self.take(size, what), dtype=np.uint8).reshape(shape)
        return data if self._immutable else data.copy()


def _preamble(reader: _Reader) -> tuple[int, int]:
    """The state's sequence id and stream count, after its magic is checked."""
    magic, seq_id = reader.unpack("<Ii", "the preamble")
    if magic != STATE_MAGIC:
        raise StateFormatError(f"not a sequence state: magic {magic:#010x}, expected {STATE_MAGIC:#010x}")
    (n_stream,) = reader.unpack("<I", "the stream count")
    return seq_id, n_stream


def _layer_header(reader: _Reader) -> tuple[int, int]:
    """A stream's V transposition flag (0 or 1) and its layer count, after its cells."""
    v_trans, n_layer = reader.unpack("<II", "the layer header")
    if v_trans > 1:
        raise StateFormatError(f"V transposition flag {v_trans}, expected 0 or 1")
    return v_trans, n_layer


def parse_state(blob: bytes) -> SequenceState:
    """The state in `blob`; StateFormatError when it is not exactly one state of the layout above."""
    reader = _Reader(blob)
    seq_id, n_stream = _preamble(reader)
    streams = []
    for index in range(n_stream):
        if reader.remaining() < 4:
            raise StateFormatError(f"truncated state: {n_stream} streams announced, {index} present")
        streams.append(_read_stream(reader))
    if reader.remaining():
        raise StateFormatError(f"{reader.remaining()} bytes after the last stream")
    state = SequenceState(seq_id, tuple(streams))
    if len({len(stream.layers) for stream in state.streams if stream.n_cells}) > 1:
        raise StateFormatError("streams disagree on the layer count")
    return state


def check_cells(blob: bytes, length: int) -> int:
    """The number of positions a one-sequence state holds, once its cells are known to hold exactly positions
    [0, n) with n >= `length`, each once, each of the state's own sequence alone; StateFormatError otherwise
    (a shifted, negative, duplicated or missing position, a cell of several sequences, framing). Reads the
    cells only (layer data is skipped, not copied): the check every restore passes before a worker sees the
    bytes, in both modes, since llama.cpp restores whatever positions the cells name."""
    held = _held_positions(blob)
    if not np.array_equal(held, np.arange(len(held), dtype=held.dtype)):
        wrong = held[held != np.arange(len(held), dtype=held.dtype)][0]
        raise StateFormatError(f"the cells do not hold positions [0, {len(held)}) once each (position {int(wrong)} is out of place)")
    if len(held) < length:
        raise StateFormatError(f"the state holds {len(held)} positions, {length} expected")
    return len(held)


def check_cell_range(blob: bytes, start: int, stop: int) -> None:
    """The cells of a one-sequence state hold exactly positions [start, stop), each once, each of the state's
    own sequence alone (a part of a sequence's state: kvpool.daemon.books.prefixes' delta entries);
    StateFormatError otherwise. Reads the cells only, as check_cells does."""
    held = _held_positions(blob)
    if not np.array_equal(held, np.arange(start, stop, dtype=held.dtype)):
        found = f"{len(held)} cells, positions {int(held[0])} to {int(held[-1])}" if len(held) else "no cells"
        raise StateFormatError(f"the cells do not hold positions [{start}, {stop}) once each ({found})")


def _held_positions(blob: bytes) -> np.ndarray:
    """Every cell's position, sorted, once the framing and each cell's sequence are checked."""
    reader = _Reader(blob)
    seq_id, n_stream = _preamble(reader)
    positions = []
    for _ in range(n_stream):
        (n_cells,) = reader.unpack("<I", "a cell count")
        if not n_cells:
            continue
        cells = np.frombuffer(reader.take(12 * n_cells, "the cells"), dtype="<i4").reshape(n_cells, 3)
        if (cells[:, 1] != 1).any():
            raise StateFormatError(f"a cell names {int(cells[cells[:, 1] != 1][0, 1])} sequences: a one-sequence state names one")
        if (cells[:, 2] != seq_id).any():
            raise StateFormatError(f"a cell of sequence {int(cells[cells[:, 2] != seq_id][0, 2])} in a state of sequence {seq_id}")
        positions.append(cells[:, 0])
        _skip_layers(reader, n_cells)
    if reader.remaining():
        raise StateFormatError(f"{reader.remaining()} bytes after the last stream")
    return np.sort(np.concatenate(positions)) if positions else np.zeros(0, np.int32)


def _skip_layers(reader: _Reader, n_cells: int) -> None:
    v_trans, n_layer = _layer_header(reader)
    for kind in ["K"] * _layer_count(reader, n_layer) + ["V"] * n_layer:
        if kind == "V" and v_trans:
            _, element_bytes, width = reader.unpack("<iII", "a transposed V header")
            reader.take(width * n_cells * element_bytes, "transposed V")
        else:
            _, row_bytes = reader.unpack("<iQ", f"a {kind} header")
            reader.take(n_cells * row_bytes, f"{kind} rows")


def _read_stream(reader: _Reader) -> Stream:
    (n_cells,) = reader.unpack("<I", "a cell count")
    if n_cells == 0:
        return Stream(np.zeros(0, np.int32), (), False, ())
    if n_cells * 8 > reader.remaining():  # a cell takes at least its position and sequence count
        raise StateFormatError(f"truncated state: {n_cells} cells announced, {reader.remaining()} bytes left")
    positions, seq_ids = _read_cells(reader, n_cells)
    v_trans, n_layer = _layer_header(reader)
    keys = [_read_rows(reader, n_cells, "K") for _ in range(_layer_count(reader, n_layer))]
    values = [_read_transposed(reader, n_cells) if v_trans else _read_rows(reader, n_cells, "V") for _ in range(n_layer)]
    layers = tuple(LayerKV(k, v) for k, v in zip(keys, values))
    return Stream(positions, seq_ids, bool(v_trans), layers)


def _read_cells(reader: _Reader, n_cells: int) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
    """The stream's cells: their positions and each one's sequence ids. When every cell names one sequence id
    (every one-sequence state's) they are read as one array of (pos, 1, seq_id) records; otherwise all of them
    one at a time, as any state's are (a cell of several ids shifts the records after it)."""
    records = reader.peek(_ONE_SEQ_CELL.size * n_cells)
    if records is not None:
        cells = np.frombuffer(records, dtype="<i4").reshape(n_cells, 3)
        if (cells[:, 1] == 1).all():
            reader.take(len(records), "the cells")
            return cells[:, 0].astype(np.int32), tuple((seq_id,) for seq_id in cells[:, 2].tolist())
    positions = np.empty(n_cells, np.int32)
    seq_ids = []
    for cell in range(n_cells):
        positions[cell], n_seq = reader.unpack("<iI", "a cell")
        seq_ids.append(struct.unpack(f"<{n_seq}i", reader.take(4 * n_seq, "a cell's sequence ids")))
    return positions, tuple(seq_ids)


def _layer_count(reader: _Reader, n_layer: int) -> int:
    # every layer takes at least two 12-byte headers: a count beyond that cannot be real
    if n_layer * 24 > reader.remaining():
        raise StateFormatError(f"truncated state: {n_layer} layers announced, {reader.remaining()} bytes left")
    return n_layer


def _read_rows(reader: _Reader, n_cells: int, kind: str) -> CellRows:
    ggml_type, row_bytes = reader.unpack("<iQ", f"a {kind} header")
    check_row_bytes(ggml_type, row_bytes, kind)
    return CellRows(ggml_type, row_bytes, reader.array((n_cells, row_bytes), f"{kind} rows"))


def _read_transposed(reader: _Reader, n_cells: int) -> TransposedRows:
    ggml_type, element_bytes, width = reader.unpack("<iII", "a transposed V header")
    block_size, type_size = _type_sizes(ggml_type, "V")
    if block_size != 1 or element_bytes != type_size or width == 0:
        raise StateFormatError(f"transposed V of type {ggml_type}: element of {element_bytes} bytes, width {width}")
    return TransposedRows(ggml_type, element_bytes, width, reader.array((width, n_cells * element_bytes), "transposed V"))


def _type_sizes(ggml_type: int, kind: str) -> tuple[int, int]:
    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise StateFormatError(f"{kind} of unknown ggml type {ggml_type}") from None


def check_row_bytes(ggml_type: int, row_bytes: int, kind: str) -> None:
    """A row is a whole, non-zero number of blocks of its ggml type (what ggml_row_size gives)."""
    _, type_size = _type_sizes(ggml_type, kind)
    if row_bytes == 0 or row_bytes % type_size:
        raise StateFormatError(f"{kind} rows of {row_bytes} bytes are not whole blocks of ggml type {ggml_type} ({type_size} bytes)")


# ---- writing ------------------------------------------------------------------------------------------------


def write_state(state: SequenceState) -> bytes:
    """The bytes of `state`, as llama.cpp writes them: parse_state(write_state(s)) == s, and
    write_state(parse_state(b)) == b."""
    return b"".join(state_parts(state))


def state_parts(state: SequenceState) -> list[bytes | memoryview]:
    """write_state's bytes in the pieces they are made of (views where the rows are contiguous), for a
    writer that copies them once into their destination (kvpool.state.shared.SharedState.written)."""
    parts: list[bytes | memoryview] = [struct.pack("<IiI", STATE_MAGIC, state.seq_id, len(state.streams))]
    for stream in state.streams:
        parts.extend(_stream_parts(stream))
    return parts


def _stream_parts(stream: Stream) -> list[bytes | memoryview]:
    parts: list[bytes | memoryview] = [struct.pack("<I", stream.n_cells)]
    if not stream.n_cells:
        return parts
    if len(stream.seq_ids) != stream.n_cells:
        raise StateFormatError(f"{stream.n_cells} cells with {len(stream.seq_ids)} lists of sequence ids")
    if all(len(ids) == 1 for ids in stream.seq_ids):
        cells = np.empty((stream.n_cells, 3), "<i4")
        cells[:, 0], cells[:, 1], cells[:, 2] = stream.positions, 1, [ids[0] for ids in stream.seq_ids]
        parts.append(cells.tobytes())
    else:
        for position, ids in zip(stream.positions.tolist(), stream.seq_ids):
            parts.append(struct.pack(f"<iI{len(ids)}i", position, len(ids), *ids))
    parts.append(struct.pack("<II", int(stream.v_transposed), len(stream.layers)))
    for layer in stream.layers:
        parts += [struct.pack("<iQ", layer.k.ggml_type, layer.k.row_bytes), _checked(layer.k.data, (stream.n_cells, layer.k.row_bytes))]
    for layer in stream.layers:
        parts += _value_parts(layer.v, stream)
    return parts


def _value_parts(v: CellRows | TransposedRows, stream: Stream) -> list[bytes]:
    if isinstance(v, TransposedRows) != stream.v_transposed:
        raise StateFormatError("a layer's V layout differs from its stream's")
    if isinstance(v, TransposedRows):
        return [struct.pack("<iII", v.ggml_type, v.element_bytes, v.width), _checked(v.data, (v.width, stream.n_cells * v.element_bytes))]
    return [struct.pack("<iQ", v.ggml_type, v.row_bytes), _checked(v.data, (stream.n_cells, v.row_bytes))]


def _checked(data: np.ndarray, shape: tuple[int, int]) -> bytes | memoryview:
    """The rows' bytes for write_state's join: a view where they are contiguous (joined without a copy first)."""
    if data.dtype != np.uint8 or data.shape != shape:
        raise StateFormatError(f"rows of {data.dtype} {data.shape}, expected uint8 {shape}")
    return data.data if data.flags.c_contiguous else data.tobytes()

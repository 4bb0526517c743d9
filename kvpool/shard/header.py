"""What a GGUF file holds, read from its metadata header alone: for shard files and whole models alike.

A shard records where it came from under `kvpool.shard.*` (format, layer range, total layer count, the
source file's sha256, how many lookahead layers follow its range, and the source's digest of every block
it stores: kvpool.shard.digests); a file without those keys is a whole model. Arrays (the vocabulary) are
skipped, not materialized (but for the digests' few strings), so reading a header costs milliseconds. The
header ends with the tensor infos: where each tensor's bytes lie in the file, checked to lie inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import pathlib
import re
import struct
import types
from collections.abc import Iterator
from typing import Any

import gguf

from kvpool.shard.errors import ShardError
from kvpool.shard.ranges import LayerRange
from kvpool.wire.shape import ShardShape

SHARD_FORMAT = 1
SHARD_FORMAT_LOOKAHEAD = 2  # a shard with lookahead layers: a reader that knows only format 1 refuses it
READABLE_FORMATS = (SHARD_FORMAT, SHARD_FORMAT_LOOKAHEAD)
KEY_FORMAT = "kvpool.shard.format"
KEY_LAYER_START = "kvpool.shard.layer_start"
KEY_LAYER_STOP = "kvpool.shard.layer_stop"
KEY_TOTAL_LAYERS = "kvpool.shard.total_layers"
KEY_SOURCE_SHA256 = "kvpool.shard.source_sha256"
KEY_LOOKAHEAD_LAYERS = "kvpool.shard.lookahead_layers"
KEY_LAYER_SHA256 = "kvpool.shard.layer_sha256"  # hex strings: the source's digest of each stored block, block 0 first
_MATERIALIZED_ARRAYS = frozenset({KEY_LAYER_SHA256})  # string arrays read whole; every other array is skipped

SUPPORTED_ARCH = "llama"
NO_VOCAB_TOKENIZERS = frozenset({"none", "no_vocab"})
_GGUF_VERSIONS = (2, 3)
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")  # a block's tensor: its block (layer) index, then its name suffix
_STRING_LENGTH = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32  # GGUF's, when general.alignment is absent
_SCALAR_FORMATS = types.MappingProxyType(
    {
        gguf.GGUFValueType.UINT8: "B",
        gguf.GGUFValueType.INT8: "b",
        gguf.GGUFValueType.UINT16: "H",
        gguf.GGUFValueType.INT16: "h",
        gguf.GGUFValueType.UINT32: "I",
        gguf.GGUFValueType.INT32: "i",
        gguf.GGUFValueType.FLOAT32: "f",
        gguf.GGUFValueType.UINT64: "Q",
        gguf.GGUFValueType.INT64: "q",
        gguf.GGUFValueType.FLOAT64: "d",
        gguf.GGUFValueType.BOOL: "?",
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardInfo:
    """What a GGUF file holds, for shard files and whole (unsharded) models alike."""

    path: pathlib.Path
    arch: str
    shape: ShardShape
    source_sha256: str | None  # None for a whole model file
    vocab_free: bool
    # Layers stored after the range that never run (see kvpool.shard.contents): block_count = n_layers + this.
    lookahead_layers: int = 0
    # The source's digest of every stored block (range, then lookahead) as `kvpool shard` recorded it
    # (kvpool.shard.digests); None for a whole model and for a shard written before digests were recorded.
    layer_sha256: tuple[str, ...] | None = None

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.shape.layer_start, self.shape.layer_stop)


def file_sha256(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, "rb") as stream:
            return hashlib.file_digest(stream, "sha256").hexdigest()
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror or exc}") from exc


def read_shard_info(path: str | os.PathLike[str]) -> ShardInfo:
    path = pathlib.Path(path)
    return _info_from_header(path, _scan_header(path))


def read_whole_model_info(source: str | os.PathLike[str]) -> ShardInfo:
    """Read a whole model to shard; refuse a kvpool shard and one part of a split GGUF."""
    source = pathlib.Path(source)
    header = _scan_header(source)
    model = _info_from_header(source, header)
    if model.source_sha256 is not None:
        raise ShardError(
            f"{source} is already a kvpool shard ({model.shape}); shard the original model instead"
        )
    split_count = header.values.get("split.count")
    if isinstance(split_count, int) and split_count > 1:
        raise ShardError(f"{source} is one part of a split GGUF; merge it with gguf-split --merge first")
    return model


def check_model_file(path: pathlib.Path) -> None:
    if not path.exists():
        raise ShardError(f"model file not found: {path}")
    if not path.is_file():
        raise ShardError(f"model path is not a file: {path}")


class _Malformed(Exception):
    """The bytes are not a GGUF header this module can read."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as the header describes it: its bytes are file[offset : offset + n_bytes]."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]  # as the file stores them: ggml order, ne0 first
    offset: int  # from the start of the file (the header's offset is from the aligned data section)
    n_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class GgufHeader:
    """The metadata of a GGUF file (an array is known by its length only, but for _MATERIALIZED_ARRAYS)
    and its tensor infos, in file order."""

    values: dict[str, Any]
    array_lengths: dict[str, int]
    string_arrays: dict[str, tuple[str, ...]]
    tensors: tuple[TensorInfo, ...] = ()


class _Cursor:
    __slots__ = ("buffer", "offset")

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def skip(self, size: int) -> None:
        if self.offset + size > len(self.buffer):
            raise _Malformed("truncated header")
        self.offset += size

    def take(self, size: int) -> bytes:
        start = self.offset
        self.skip(size)
        return self.buffer[start : self.offset]

    def unpack(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("Q")).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Skip `count` length-prefixed strings (a vocabulary: ~100k of them, so one tight loop)."""
        offset, end, unpack_length = self.offset, len(self.buffer), _STRING_LENGTH.unpack_from
        for _ in range(count):
            if offset + _STRING_LENGTH.size > end:
                raise _Malformed("truncated header")
            offset += _STRING_LENGTH.size + unpack_length(self.buffer, offset)[0]
        if offset > end:
            raise _Malformed("truncated header")
        self.offset = offset


def _scan_header(path: pathlib.Path) -> GgufHeader:
    """Read the metadata of a GGUF file without materializing its arrays (GGUFReader takes seconds on a vocabulary)."""
    with mapped_gguf(path) as (header, _buffer):
        return header


@contextlib.contextmanager
def mapped_gguf(path: pathlib.Path) -> Iterator[tuple[GgufHeader, mmap.mmap]]:
    """The header of a GGUF file and the file mapped read-only, for reading tensor bytes inside the block
    (views of the buffer must not outlive it). ShardError for a file that is not a GGUF this module reads."""
    check_model_file(path)
    try:
        if path.stat().st_size == 0:
            raise _Malformed("the file is empty")
        with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            yield _parse_header(_Cursor(buffer)), buffer
    except _Malformed as exc:
        raise ShardError(f"{path} is not a GGUF file ({exc})") from exc
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _parse_header(cursor: _Cursor) -> GgufHeader:
    if cursor.take(4) != b"GGUF":
        raise _Malformed("no GGUF magic number")
    version = cursor.unpack("I")
    if version not in _GGUF_VERSIONS:
        raise _Malformed(f"unsupported GGUF version {version}; only little-endian versions 2 and 3 are read")
    tensor_count = cursor.unpack("Q")
    kv_count = cursor.unpack("Q")
    header = GgufHeader({}, {}, {})
    for _ in range(kv_count):
        key = cursor.string()
        value_type = cursor.unpack("I")
        if value_type == gguf.GGUFValueType.ARRAY and key in _MATERIALIZED_ARRAYS:
            header.string_arrays[key] = _string_array(cursor, key)
            header.array_lengths[key] = len(header.string_arrays[key])
        elif value_type == gguf.GGUFValueType.ARRAY:
            header.array_lengths[key] = _skip_array(cursor)
        else:
            header.values[key] = _scalar(cursor, value_type)
    return dataclasses.replace(header, tensors=_tensor_infos(cursor, tensor_count, header.values.get("general.alignment", _DEFAULT_ALIGNMENT)))


def _tensor_infos(cursor: _Cursor, count: int, alignment: Any) -> tuple[TensorInfo, ...]:
    """The tensor infos that end the header, with offsets from the file's start; the data section begins at
    the next multiple of `alignment` after them."""
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        raise _Malformed(f"general.alignment {alignment!r} is not a positive integer")
    described = []
    for _ in range(count):
        name = cursor.string()
        dims = tuple(cursor.unpack("Q") for _ in range(cursor.unpack("I")))
        ggml_type, offset = cursor.unpack("I"), cursor.unpack("Q")
        described.append((name, ggml_type, dims, offset))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, ggml_type, dims, offset in described:
        tensor = TensorInfo(name, ggml_type, dims, data_start + offset, _tensor_bytes(name, ggml_type, dims))
        if tensor.offset + tensor.n_bytes > len(cursor.buffer):
            raise _Malformed(f"the data of tensor {name} lies past the end of the file")
        tensors.append(tensor)
    return tuple(tensors)


def _tensor_bytes(name: str, ggml_type: int, dims: tuple[int, ...]) -> int:
    try:
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise _Malformed(f"tensor {name} has an unknown ggml type {ggml_type}") from None
    elements = 1
    for dim in dims:
        elements *= dim
    if elements % block_size:
        raise _Malformed(f"tensor {name} of {elements} elements is not whole blocks of {block_size}")
    return elements // block_size * type_size


def _string_array(cursor: _Cursor, key: str) -> tuple[str, ...]:
    if cursor.unpack("I") != gguf.GGUFValueType.STRING:
        raise _Malformed(f"metadata key {key} is not an array of strings")
    return tuple(cursor.string() for _ in range(cursor.unpack("Q")))


def _scalar(cursor: _Cursor, value_type: int) -> Any:
    if value_type == gguf.GGUFValueType.STRING:
        return cursor.string()
    fmt = _SCALAR_FORMATS.get(value_type)
    if fmt is None:
        raise _Malformed(f"unknown metadata value type {value_type}")
    return cursor.unpack(fmt)


def _skip_array(cursor: _Cursor) -> int:
    element_type = cursor.unpack("I")
    length = cursor.unpack("Q")
    if element_type == gguf.GGUFValueType.STRING:
        cursor.skip_strings(length)
    elif element_type == gguf.GGUFValueType.ARRAY:
        for _ in range(length):
            _skip_array(cursor)
    elif element_type in _SCALAR_FORMATS:
        cursor.skip(length * struct.calcsize(_SCALAR_FORMATS[element_type]))
    else:
        raise _Malformed(f"unknown metadata array type {element_type}")
    return length


def _info_from_header(path: pathlib.Path, header: GgufHeader) -> ShardInfo:
    def value(key: str) -> Any:
        if key not in header.values:
            raise ShardError(f"{path} lacks the metadata key {key}")
        return header.values[key]

    def integer(key: str) -> int:
        number = value(key)
        if not isinstance(number, int) or isinstance(number, bool):
            raise ShardError(f"{path}: metadata key {key} is not an integer")
        return number

    arch = value("general.architecture")
    if arch != SUPPORTED_ARCH:
        raise ShardError(
            f"{path.name}: architecture '{arch}' is not supported; kvpool shards llama-family models only"
        )
    block_count = integer(f"{arch}.block_count")
    n_embd = integer(f"{arch}.embedding_length")
    vocab_free = value("tokenizer.ggml.model") in NO_VOCAB_TOKENIZERS
    if vocab_free:
        n_vocab = integer(f"{arch}.vocab_size") if f"{arch}.vocab_size" in header.values else 0
    elif "tokenizer.ggml.tokens" in header.array_lengths:
        n_vocab = header.array_lengths["tokenizer.ggml.tokens"]
    else:
        raise ShardError(f"{path} lacks the metadata key tokenizer.ggml.tokens")
    if KEY_FORMAT not in header.values:
        shape = ShardShape(layer_start=0, layer_stop=block_count, total_layers=block_count, n_embd=n_embd, n_vocab=n_vocab)
        return ShardInfo(path, arch, shape, None, vocab_free)
    shard_format = integer(KEY_FORMAT)
    if shard_format not in READABLE_FORMATS:
        raise ShardError(
            f"{path} is a kvpool shard of format {shard_format}; this kvpool reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))}"
        )
    start, stop, total = integer(KEY_LAYER_START), integer(KEY_LAYER_STOP), integer(KEY_TOTAL_LAYERS)
    lookahead = integer(KEY_LOOKAHEAD_LAYERS) if KEY_LOOKAHEAD_LAYERS in header.values else 0
    if not 0 <= start < stop <= total or stop - start + lookahead != block_count or not 0 <= lookahead <= total - stop:
        raise ShardError(
            f"{path} has inconsistent shard metadata: layers {start}:{stop} of {total}, "
            f"{lookahead} lookahead, block_count {block_count}"
        )
    layer_sha256 = header.string_arrays.get(KEY_LAYER_SHA256)
    if layer_sha256 is not None and (len(layer_sha256) != block_count or not all(map(_is_sha256_hex, layer_sha256))):
        raise ShardError(f"{path} has inconsistent shard metadata: {KEY_LAYER_SHA256} is not one sha256 per block ({block_count})")
    shape = ShardShape(layer_start=start, layer_stop=stop, total_layers=total, n_embd=n_embd, n_vocab=n_vocab)
    return ShardInfo(path, arch, shape, str(value(KEY_SOURCE_SHA256)), vocab_free, lookahead, layer_sha256)


def _is_sha256_hex(text: str) -> bool:
    return len(text) == 64 and all(char in "0123456789abcdef" for char in text)

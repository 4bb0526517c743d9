"""What a GGUF file holds, read from its metadata header alone: for shard files and whole models alike.

A shard records where it came from under `kvpool.shard.*` (format, layer range, total layer count, the
source file's sha256, and how many lookahead layers follow its range); a file without those keys is a
whole model. Arrays (the vocabulary) are skipped,
not materialized, so reading a header costs milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import pathlib
import struct
import types
from typing import Any

import gguf

from kvpool.shard.ranges import LayerRange
from kvpool.shard.errors import ShardError
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

SUPPORTED_ARCH = "llama"
NO_VOCAB_TOKENIZERS = frozenset({"none", "no_vocab"})
_GGUF_VERSIONS = (2, 3)
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
class _Header:
    """The metadata of a GGUF file; an array is known by its length only."""

    values: dict[str, Any]
    array_lengths: dict[str, int]


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


def _scan_header(path: pathlib.Path) -> _Header:
    """Read the metadata of a GGUF file without materializing its arrays (GGUFReader takes seconds on a vocabulary)."""
    check_model_file(path)
    try:
        if path.stat().st_size == 0:
            raise _Malformed("the file is empty")
        with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _parse_header(_Cursor(buffer))
    except _Malformed as exc:
        raise ShardError(f"{path} is not a GGUF file ({exc})") from exc
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _parse_header(cursor: _Cursor) -> _Header:
    if cursor.take(4) != b"GGUF":
        raise _Malformed("no GGUF magic number")
    version = cursor.unpack("I")
    if version not in _GGUF_VERSIONS:
        raise _Malformed(f"unsupported GGUF version {version}; only little-endian versions 2 and 3 are read")
    cursor.unpack("Q")  # tensor count
    kv_count = cursor.unpack("Q")
    header = _Header({}, {})
    for _ in range(kv_count):
        key = cursor.string()
        value_type = cursor.unpack("I")
        if value_type == gguf.GGUFValueType.ARRAY:
            header.array_lengths[key] = _skip_array(cursor)
        else:
            header.values[key] = _scalar(cursor, value_type)
    return header


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
        for _ in range(length):
            cursor.skip(cursor.unpack("Q"))
    elif element_type == gguf.GGUFValueType.ARRAY:
        for _ in range(length):
            _skip_array(cursor)
    elif element_type in _SCALAR_FORMATS:
        cursor.skip(length * struct.calcsize(_SCALAR_FORMATS[element_type]))
    else:
        raise _Malformed(f"unknown metadata array type {element_type}")
    return length


def _info_from_header(path: pathlib.Path, header: _Header) -> ShardInfo:
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
    shape = ShardShape(layer_start=start, layer_stop=stop, total_layers=total, n_embd=n_embd, n_vocab=n_vocab)
    return ShardInfo(path, arch, shape, str(value(KEY_SOURCE_SHA256)), vocab_free, lookahead)

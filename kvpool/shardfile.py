"""Shard GGUF files: the layers [A, B) of a llama-family model, loadable by llama.cpp as a model of B - A layers.

A shard is written with gguf-py (the reader/writer llama.cpp publishes). Every metadata key is copied with
its type, `<arch>.block_count` becomes the local layer count, the tensors `blk.i.*` for i in [A, B) are
copied byte for byte as `blk.(i-A).*`, and the shard records where it came from under `kvpool.shard.*`.

Invariants of a shard file:
- the first shard (A == 0) keeps the real vocabulary and embeddings: it takes token ids;
- the last shard (B == total) keeps the vocabulary and the output head: it produces logits;
- a middle shard is vocabulary-free (tokenizer model "none", 32 dummy tokens, a zero 32-row
  `token_embd.weight`, no `output.weight`): it takes and returns hidden states only.
Files appear atomically: written to `.{name}.partial-{pid}` beside the target, then renamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import pathlib
import re
import struct
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import gguf
import numpy as np

SHARD_FORMAT = 1
KEY_FORMAT = "kvpool.shard.format"
KEY_LAYER_START = "kvpool.shard.layer_start"
KEY_LAYER_STOP = "kvpool.shard.layer_stop"
KEY_TOTAL_LAYERS = "kvpool.shard.total_layers"
KEY_SOURCE_SHA256 = "kvpool.shard.source_sha256"

SUPPORTED_ARCH = "llama"
VOCAB_FREE_SIZE = 32
NO_VOCAB_TOKENIZERS = frozenset({"none", "no_vocab"})

# Keys gguf.GGUFWriter emits itself; copying them would duplicate or contradict its own.
_WRITER_OWNED_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"})
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_RANGE_TEXT = re.compile(r"(\d+):(\d+)")
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

Progress = Callable[[str], None]


class ShardError(Exception):
    """A shard cannot be read or written; the message is one user-facing line."""


@dataclasses.dataclass(frozen=True, slots=True)
class LayerRange:
    """Half-open layer range [start, stop); never empty."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ShardError(f"layer range {self} starts below 0")
        if self.stop <= self.start:
            raise ShardError(f"layer range {self} is empty: the stop layer must be greater than the start layer")

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    @property
    def n_layers(self) -> int:
        return self.stop - self.start


def parse_layers(text: str) -> LayerRange:
    """Parse "A:B" (half-open) into a LayerRange."""
    match = _RANGE_TEXT.fullmatch(text.strip())
    if match is None:
        raise ShardError(f"bad layer range {text!r}: expected START:STOP, e.g. 0:10")
    return LayerRange(int(match.group(1)), int(match.group(2)))


def validate_range(layers: LayerRange, total_layers: int) -> None:
    if layers.stop > total_layers:
        raise ShardError(
            f"layer range {layers} is out of bounds: the model has {total_layers} layers (0:{total_layers})"
        )


def parse_splits(text: str, total_layers: int) -> list[LayerRange]:
    """Parse "0:10,10:20,20:30": ranges that together cover [0, total_layers) exactly once, in layer order."""
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ShardError(f"bad splits {text!r}: expected comma-separated START:STOP ranges, e.g. 0:10,10:30")
    ranges = sorted((parse_layers(item) for item in items), key=lambda r: (r.start, r.stop))
    covered = 0
    previous: LayerRange | None = None
    for layer_range in ranges:
        validate_range(layer_range, total_layers)
        if layer_range.start < covered:
            raise ShardError(f"splits overlap: {previous} and {layer_range} share layers {layer_range.start}:{covered}")
        if layer_range.start > covered:
            raise ShardError(f"splits leave a gap: layers {covered}:{layer_range.start} are in no range")
        covered = layer_range.stop
        previous = layer_range
    if covered < total_layers:
        raise ShardError(f"splits leave a gap: layers {covered}:{total_layers} are in no range")
    return ranges


def even_splits(total_layers: int, parts: int) -> list[LayerRange]:
    """Split [0, total_layers) into `parts` contiguous ranges whose sizes differ by at most one; earlier are larger."""
    if parts < 1:
        raise ShardError(f"cannot split into {parts} parts: need at least 1")
    if parts > total_layers:
        raise ShardError(f"cannot split {total_layers} layers into {parts} parts: at most {total_layers}")
    base, extra = divmod(total_layers, parts)
    ranges: list[LayerRange] = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        ranges.append(LayerRange(start, stop))
        start = stop
    return ranges


@dataclasses.dataclass(frozen=True, slots=True)
class ShardInfo:
    """What a GGUF file holds, for shard files and whole (unsharded) models alike."""

    path: pathlib.Path
    arch: str
    layer_start: int
    layer_stop: int
    total_layers: int
    n_embd: int
    n_vocab: int  # as llama.cpp sees it: 32 for a vocabulary-free middle shard
    source_sha256: str | None  # None for a whole model file
    vocab_free: bool

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_stop == self.total_layers

    @property
    def n_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.layer_start, self.layer_stop)


def file_sha256(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, "rb") as stream:
            return hashlib.file_digest(stream, "sha256").hexdigest()
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror or exc}") from exc


def shard_file_name(source: str | os.PathLike[str], layers: LayerRange) -> str:
    return f"{pathlib.Path(source).stem}.layers-{layers.start:02d}-{layers.stop:02d}.gguf"


def read_shard_info(path: str | os.PathLike[str]) -> ShardInfo:
    path = pathlib.Path(path)
    return _info_from_header(path, _scan_header(path))


def write_shard(
    source: str | os.PathLike[str],
    layers: LayerRange,
    out: str | os.PathLike[str],
    *,
    source_sha256: str | None = None,
    progress: Progress | None = None,
) -> ShardInfo:
    """Write the shard of `source` holding `layers` to `out` (a file, or an existing directory to write into)."""
    source, out = pathlib.Path(source), pathlib.Path(out)
    report = progress or _silent
    model = _whole_model_info(source)
    validate_range(layers, model.total_layers)
    if out.is_dir():
        out = out / shard_file_name(source, layers)
    _refuse_overwriting_source(source, out)
    report(f"reading {source.name}")
    reader = _open_reader(source)
    created_dirs = _make_directory(out.parent)
    try:
        if source_sha256 is None:
            report("hashing source")
            source_sha256 = file_sha256(source)
        written = _publish(reader, model, [(layers, out)], source_sha256, report)
    except BaseException:
        _remove_empty_directories(created_dirs)
        raise
    return written[0]


def write_shards(
    source: str | os.PathLike[str],
    ranges: Sequence[LayerRange],
    out_dir: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> list[ShardInfo]:
    """Write one shard per range into `out_dir`, all or nothing; the source is hashed once."""
    source, out_dir = pathlib.Path(source), pathlib.Path(out_dir)
    report = progress or _silent
    if not ranges:
        raise ShardError("no layer ranges given")
    if len(set(ranges)) != len(ranges):
        raise ShardError(f"a layer range is given twice: {','.join(map(str, ranges))}")
    model = _whole_model_info(source)
    for layers in ranges:
        validate_range(layers, model.total_layers)
    if out_dir.exists() and not out_dir.is_dir():
        raise ShardError(f"output {out_dir} exists and is not a directory")
    targets = [(layers, out_dir / shard_file_name(source, layers)) for layers in ranges]
    for _, target in targets:
        _refuse_overwriting_source(source, target)
    report(f"reading {source.name}")
    reader = _open_reader(source)
    created_dirs = _make_directory(out_dir)
    try:
        report("hashing source")
        source_sha256 = file_sha256(source)
        return _publish(reader, model, targets, source_sha256, report)
    except BaseException:
        _remove_empty_directories(created_dirs)
        raise


def _silent(_message: str) -> None:
    pass


def _check_file(path: pathlib.Path) -> None:
    if not path.exists():
        raise ShardError(f"model file not found: {path}")
    if not path.is_file():
        raise ShardError(f"model path is not a file: {path}")


def _open_reader(path: pathlib.Path) -> gguf.GGUFReader:
    _check_file(path)
    try:
        reader = gguf.GGUFReader(path)
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except Exception as exc:  # the parser fails in many ways on bytes that are not GGUF
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShardError(f"{path} is not a GGUF file ({reason})") from exc
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ShardError(f"{path} is a big-endian GGUF file, which kvpool does not support")
    return reader


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
    _check_file(path)
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
        return ShardInfo(path, arch, 0, block_count, block_count, n_embd, n_vocab, None, vocab_free)
    shard_format = integer(KEY_FORMAT)
    if shard_format != SHARD_FORMAT:
        raise ShardError(f"{path} is a kvpool shard of format {shard_format}; this kvpool reads format {SHARD_FORMAT}")
    start, stop, total = integer(KEY_LAYER_START), integer(KEY_LAYER_STOP), integer(KEY_TOTAL_LAYERS)
    if not 0 <= start < stop <= total or stop - start != block_count:
        raise ShardError(
            f"{path} has inconsistent shard metadata: layers {start}:{stop} of {total}, block_count {block_count}"
        )
    return ShardInfo(path, arch, start, stop, total, n_embd, n_vocab, str(value(KEY_SOURCE_SHA256)), vocab_free)


def _whole_model_info(source: pathlib.Path) -> ShardInfo:
    header = _scan_header(source)
    model = _info_from_header(source, header)
    if model.source_sha256 is not None:
        raise ShardError(
            f"{source} is already a kvpool shard (layers {model.layer_start}:{model.layer_stop} of "
            f"{model.total_layers}); shard the original model instead"
        )
    split_count = header.values.get("split.count")
    if isinstance(split_count, int) and split_count > 1:
        raise ShardError(f"{source} is one part of a split GGUF; merge it with gguf-split --merge first")
    return model


def _refuse_overwriting_source(source: pathlib.Path, target: pathlib.Path) -> None:
    if target.exists() and target.resolve() == source.resolve():
        raise ShardError(f"output {target} is the source model itself")


def _make_directory(directory: pathlib.Path) -> list[pathlib.Path]:
    """Create `directory` and missing parents; return those created, deepest first."""
    missing: list[pathlib.Path] = []
    probe = directory
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise ShardError(f"output {probe} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardError(f"cannot create directory {directory}: {exc.strerror or exc}") from exc
    return missing


def _remove_empty_directories(directories: Iterable[pathlib.Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


def _partial_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(f".{target.name}.partial-{os.getpid()}")


def _publish(
    reader: gguf.GGUFReader,
    model: ShardInfo,
    targets: Sequence[tuple[LayerRange, pathlib.Path]],
    source_sha256: str,
    report: Progress,
) -> list[ShardInfo]:
    """Write every target to its partial file, then rename them all into place; on failure leave none behind."""
    partials: list[pathlib.Path] = []
    published: list[pathlib.Path] = []
    try:
        for index, (layers, target) in enumerate(targets, start=1):
            report(f"writing {target.name}" + (f" ({index}/{len(targets)})" if len(targets) > 1 else ""))
            partial = _partial_path(target)
            partials.append(partial)
            _write_file(reader, model, layers, source_sha256, partial)
        for partial, (_, target) in zip(partials, targets):
            os.replace(partial, target)
            published.append(target)
    except OSError as exc:
        _unlink_all([*partials, *published])
        target = exc.filename2 or exc.filename or "shard"
        raise ShardError(f"cannot write {target}: {exc.strerror or exc}") from exc
    except BaseException:
        _unlink_all([*partials, *published])
        raise
    return [_shard_info(model, layers, target, source_sha256) for layers, target in targets]


def _unlink_all(paths: Iterable[pathlib.Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # not ours to remove: something else (a directory) stands at that path


def _is_middle(model: ShardInfo, layers: LayerRange) -> bool:
    return layers.start > 0 and layers.stop < model.total_layers


def _shard_info(model: ShardInfo, layers: LayerRange, path: pathlib.Path, source_sha256: str) -> ShardInfo:
    vocab_free = model.vocab_free or _is_middle(model, layers)
    n_vocab = VOCAB_FREE_SIZE if _is_middle(model, layers) else model.n_vocab
    return ShardInfo(
        path, model.arch, layers.start, layers.stop, model.total_layers, model.n_embd, n_vocab, source_sha256, vocab_free
    )


def _write_file(
    reader: gguf.GGUFReader, model: ShardInfo, layers: LayerRange, source_sha256: str, path: pathlib.Path
) -> None:
    writer = gguf.GGUFWriter(path, model.arch)
    try:
        _add_metadata(writer, reader, model, layers, source_sha256)
        _add_tensors(writer, reader, model, layers)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add_metadata(
    writer: gguf.GGUFWriter, reader: gguf.GGUFReader, model: ShardInfo, layers: LayerRange, source_sha256: str
) -> None:
    arch = model.arch
    vocab_free = _is_middle(model, layers)
    for key, field in reader.fields.items():
        if key in _WRITER_OWNED_KEYS:
            continue
        if key == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
            continue
        if vocab_free and (key.startswith("tokenizer.") or key == f"{arch}.vocab_size"):
            continue
        value, value_type, sub_type = _field_value(key, field)
        if key == f"{arch}.block_count":
            value = layers.n_layers
        elif _is_per_layer_array(key, arch, value_type, sub_type, value, model.total_layers):
            value = value[layers.start : layers.stop]
        if value_type == gguf.GGUFValueType.ARRAY and not value:
            continue  # gguf-py cannot write an empty array; llama.cpp treats it like an absent key
        writer.add_key_value(key, value, value_type, sub_type)
    if vocab_free:
        _add_dummy_vocabulary(writer, reader, arch)
    writer.add_uint32(KEY_FORMAT, SHARD_FORMAT)
    writer.add_uint32(KEY_LAYER_START, layers.start)
    writer.add_uint32(KEY_LAYER_STOP, layers.stop)
    writer.add_uint32(KEY_TOTAL_LAYERS, model.total_layers)
    writer.add_string(KEY_SOURCE_SHA256, source_sha256)


def _field_value(key: str, field: Any) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """The value of a reader field in the form GGUFWriter.add_key_value takes; strings stay raw bytes."""
    value_type = gguf.GGUFValueType(field.types[0])
    if value_type == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]), value_type, None
    if value_type != gguf.GGUFValueType.ARRAY:
        return field.parts[-1].tolist()[0], value_type, None
    # parts of an array field: key length, key, value type, element type, length, elements...
    sub_type = gguf.GGUFValueType(int(field.parts[3][0]))
    if sub_type == gguf.GGUFValueType.ARRAY:
        raise ShardError(f"metadata key {key} is a nested array, which kvpool cannot copy")
    if sub_type == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[index]) for index in field.data], value_type, sub_type
    return [field.parts[index].tolist()[0] for index in field.data], value_type, sub_type


def _is_per_layer_array(
    key: str,
    arch: str,
    value_type: gguf.GGUFValueType,
    sub_type: gguf.GGUFValueType | None,
    value: Any,
    total_layers: int,
) -> bool:
    # llama.cpp reads hyperparameters such as `<arch>.feed_forward_length` either as a scalar or as an array
    # with one entry per layer; a shard of n layers must carry exactly its n entries.
    return (
        key.startswith(f"{arch}.")
        and value_type == gguf.GGUFValueType.ARRAY
        and sub_type not in (gguf.GGUFValueType.STRING, None)
        and len(value) == total_layers
    )


def _add_dummy_vocabulary(writer: gguf.GGUFWriter, reader: gguf.GGUFReader, arch: str) -> None:
    # llama.cpp's "none" tokenizer reads only `<arch>.vocab_size`; the arrays keep tools that list them consistent.
    writer.add_string("tokenizer.ggml.model", "none")
    writer.add_key_value(
        "tokenizer.ggml.tokens",
        [f"<kvpool-unused-{index}>".encode() for index in range(VOCAB_FREE_SIZE)],
        gguf.GGUFValueType.ARRAY,
        gguf.GGUFValueType.STRING,
    )
    scores = reader.get_field("tokenizer.ggml.scores")
    if scores is not None:
        score_type = gguf.GGUFValueType(int(scores.parts[3][0]))
        writer.add_key_value("tokenizer.ggml.scores", [0.0] * VOCAB_FREE_SIZE, gguf.GGUFValueType.ARRAY, score_type)
    token_types = reader.get_field("tokenizer.ggml.token_type")
    if token_types is not None:
        element_type = gguf.GGUFValueType(int(token_types.parts[3][0]))
        writer.add_key_value(
            "tokenizer.ggml.token_type",
            [int(gguf.TokenType.UNUSED)] * VOCAB_FREE_SIZE,
            gguf.GGUFValueType.ARRAY,
            element_type,
        )
    writer.add_uint32(f"{arch}.vocab_size", VOCAB_FREE_SIZE)


def _add_tensors(writer: gguf.GGUFWriter, reader: gguf.GGUFReader, model: ShardInfo, layers: LayerRange) -> None:
    vocab_free = _is_middle(model, layers)
    for tensor in reader.tensors:
        match = _BLOCK_TENSOR.fullmatch(tensor.name)
        if match is not None:
            layer = int(match.group(1))
            if layers.start <= layer < layers.stop:
                _copy_tensor(writer, tensor, f"blk.{layer - layers.start}.{match.group(2)}")
        elif vocab_free and tensor.name == "token_embd.weight":
            writer.add_tensor(tensor.name, np.zeros((VOCAB_FREE_SIZE, model.n_embd), dtype=np.float32))
        elif vocab_free and tensor.name.startswith("output."):
            continue
        else:
            _copy_tensor(writer, tensor, tensor.name)


def _copy_tensor(writer: gguf.GGUFWriter, tensor: Any, name: str) -> None:
    # GGUFReader exposes a quantized tensor as uint8 rows of bytes; given raw_dtype, GGUFWriter maps that
    # byte shape back to the element shape, so the file records the source's shape and type unchanged.
    writer.add_tensor(name, tensor.data, raw_dtype=gguf.GGMLQuantizationType(tensor.tensor_type))

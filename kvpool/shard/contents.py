"""What one shard file holds: the layers [A, B) of a llama-family model, loadable as a model of B - A layers.

Every metadata key is copied with its type, `<arch>.block_count` becomes the local layer count, per-layer
arrays keep their entries for [A, B), the tensors `blk.i.*` for i in [A, B) are copied byte for byte as
`blk.(i-A).*`, and the shard records where it came from under `kvpool.shard.*`, with the source's digest of
every block it stores (kvpool.shard.digests: what a daemon checks its file against at load).

Invariants of a shard file:
- the first shard (A == 0) keeps the real vocabulary and embeddings: it takes token ids;
- the last shard (B == total) keeps the vocabulary and the output head: it produces logits;
- only the last shard holds the `output.*` tensors of a separate output head: the others never run it
  (hundreds of MB on a model with a large vocabulary). llama.cpp loads a file without `output.weight`
  with the head tied to `token_embd.weight`; `output_norm.weight`, which it requires, stays everywhere;
- a middle shard is vocabulary-free (tokenizer model "none", 32 dummy tokens, a zero 32-row
  `token_embd.weight`): it takes and returns hidden states only;
- the first shard of a split also stores layer B, as its last block, a *lookahead layer* that never runs
  (`kvpool.shard.lookahead_layers` = 1). llama.cpp keeps only the rows marked as outputs in the model's
  last layer and sizes its output buffer n_vocab x outputs; with the lookahead layer last, the shard's own
  layers keep every row while marking one output per batch, so its context is not charged the logits of
  every row (96 MiB at 512 rows and a 49k vocabulary). The runtime stops the graph after layer B - 1.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np

from kvpool.shard.errors import ShardError
from kvpool.shard.header import (
    BLOCK_TENSOR,
    KEY_FORMAT,
    KEY_LAYER_SHA256,
    KEY_LAYER_START,
    KEY_LAYER_STOP,
    KEY_LOOKAHEAD_LAYERS,
    KEY_SOURCE_SHA256,
    KEY_TOTAL_LAYERS,
    SHARD_FORMAT,
    SHARD_FORMAT_LOOKAHEAD,
    ShardInfo,
)
from kvpool.shard.ranges import LayerRange
from kvpool.wire.shape import ShardShape

VOCAB_FREE_SIZE = 32

# Keys gguf.GGUFWriter emits itself; copying them would duplicate or contradict its own.
_WRITER_OWNED_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"})


def shard_info(
    model: ShardInfo, layers: LayerRange, path: pathlib.Path, source_sha256: str, source_layer_sha256: Sequence[str]
) -> ShardInfo:
    """The ShardInfo of the shard of `model` holding `layers`, as read_shard_info will read it back;
    `source_layer_sha256`: the source's digest of every layer (kvpool.shard.digests.block_digests)."""
    vocab_free = model.vocab_free or _is_middle(model, layers)
    n_vocab = VOCAB_FREE_SIZE if _is_middle(model, layers) else model.shape.n_vocab
    shape = ShardShape(
        layer_start=layers.start, layer_stop=layers.stop, total_layers=model.shape.total_layers, n_embd=model.shape.n_embd, n_vocab=n_vocab
    )
    stored = stored_layers(model.shape.total_layers, layers)
    return ShardInfo(
        path, model.arch, shape, source_sha256, vocab_free, lookahead_layers(model.shape.total_layers, layers),
        tuple(source_layer_sha256[stored.start : stored.stop]),
    )


def lookahead_layers(total_layers: int, layers: LayerRange) -> int:
    """Layers stored after `layers` that never run: one for the first shard of a split (see above)."""
    return 1 if layers.start == 0 and layers.stop < total_layers else 0


def stored_layers(total_layers: int, layers: LayerRange) -> LayerRange:
    """The source layers a shard of `layers` stores as its blocks: its range, then its lookahead layers."""
    return LayerRange(layers.start, layers.stop + lookahead_layers(total_layers, layers))


def write_shard_file(
    reader: gguf.GGUFReader,
    model: ShardInfo,
    layers: LayerRange,
    source_sha256: str,
    source_layer_sha256: Sequence[str],
    path: pathlib.Path,
) -> None:
    """Write the shard of `model` holding `layers` to `path` itself; making it appear atomically is the caller's."""
    if len(source_layer_sha256) != model.shape.total_layers:
        raise ShardError(f"{len(source_layer_sha256)} layer digests for a source of {model.shape.total_layers} layers")
    writer = gguf.GGUFWriter(path, model.arch)
    try:
        _add_metadata(writer, reader, model, layers, source_sha256, source_layer_sha256)
        _add_tensors(writer, reader, model, layers)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _is_middle(model: ShardInfo, layers: LayerRange) -> bool:
    return layers.start > 0 and layers.stop < model.shape.total_layers


def _add_metadata(
    writer: gguf.GGUFWriter,
    reader: gguf.GGUFReader,
    model: ShardInfo,
    layers: LayerRange,
    source_sha256: str,
    source_layer_sha256: Sequence[str],
) -> None:
    arch = model.arch
    vocab_free = _is_middle(model, layers)
    stored = stored_layers(model.shape.total_layers, layers)
    for key, field in reader.fields.items():
        if key in _WRITER_OWNED_KEYS:
            continue
        if key == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
            continue
        if vocab_free and (key.startswith("tokenizer.") or key == f"{arch}.vocab_size"):
            continue
        value, value_type, sub_type = field_value(key, field)
        if key == f"{arch}.block_count":
            value = stored.n_layers
        elif _is_per_layer_array(key, arch, value_type, sub_type, value, model.shape.total_layers):
            value = value[stored.start : stored.stop]
        if value_type == gguf.GGUFValueType.ARRAY and not value:
            continue  # gguf-py cannot write an empty array; llama.cpp treats it like an absent key
        writer.add_key_value(key, value, value_type, sub_type)
    if vocab_free:
        _add_dummy_vocabulary(writer, reader, arch)
    writer.add_uint32(KEY_FORMAT, SHARD_FORMAT_LOOKAHEAD if stored.stop > layers.stop else SHARD_FORMAT)
    writer.add_uint32(KEY_LAYER_START, layers.start)
    writer.add_uint32(KEY_LAYER_STOP, layers.stop)
    writer.add_uint32(KEY_TOTAL_LAYERS, model.shape.total_layers)
    writer.add_string(KEY_SOURCE_SHA256, source_sha256)
    if stored.stop > layers.stop:
        writer.add_uint32(KEY_LOOKAHEAD_LAYERS, stored.stop - layers.stop)
    writer.add_array(KEY_LAYER_SHA256, list(source_layer_sha256[stored.start : stored.stop]))


def field_value(key: str, field: Any) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
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
    runs_head = layers.stop == model.shape.total_layers
    stored = stored_layers(model.shape.total_layers, layers)
    for tensor in reader.tensors:
        match = BLOCK_TENSOR.fullmatch(tensor.name)
        if match is not None:
            layer = int(match.group(1))
            if stored.start <= layer < stored.stop:
                _copy_tensor(writer, tensor, f"blk.{layer - layers.start}.{match.group(2)}")
        elif vocab_free and tensor.name == "token_embd.weight":
            writer.add_tensor(tensor.name, np.zeros((VOCAB_FREE_SIZE, model.shape.n_embd), dtype=np.float32))
        elif not runs_head and tensor.name.startswith("output."):
            continue
        else:
            _copy_tensor(writer, tensor, tensor.name)


def _copy_tensor(writer: gguf.GGUFWriter, tensor: Any, name: str) -> None:
    # GGUFReader exposes a quantized tensor as uint8 rows of bytes; given raw_dtype, GGUFWriter maps that
    # byte shape back to the element shape, so the file records the source's shape and type unchanged.
    writer.add_tensor(name, tensor.data, raw_dtype=gguf.GGMLQuantizationType(tensor.tensor_type))

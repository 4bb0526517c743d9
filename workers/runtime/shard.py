"""Where a loaded shard sits in the whole model (its ShardShape) and the shape of its KV cache rows, read from
the GGUF by llama.cpp itself."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib

import gguf
import llama_cpp

from kvpool.wire.shape import ShardShape

META_PREFIX = "kvpool.shard."


def meta_value(model: llama_cpp.llama_model_p, key: str) -> str | None:
    buffer = ctypes.create_string_buffer(256)
    written = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, ctypes.sizeof(buffer))
    return buffer.value.decode() if written >= 0 else None


def read_lookahead_layers(model: llama_cpp.llama_model_p) -> int:
    """Layers stored after the shard's range that llama.cpp loads but never runs: the first shard of a
    split has one (kvpool.shard.contents), so that pruning to the output rows happens in a layer that never
    runs and the shard's own last layer keeps every row without every row marked as an output."""
    return int(meta_value(model, META_PREFIX + "lookahead_layers") or 0)


def read_shape(model: llama_cpp.llama_model_p) -> ShardShape:
    n_layer = llama_cpp.llama_model_n_layer(model)
    vocab = llama_cpp.llama_model_get_vocab(model)
    start = meta_value(model, META_PREFIX + "layer_start")
    stop = meta_value(model, META_PREFIX + "layer_stop")
    total = meta_value(model, META_PREFIX + "total_layers")
    if start is None or stop is None or total is None:
        start, stop, total = "0", str(n_layer), str(n_layer)
    shape = ShardShape(
        layer_start=int(start),
        layer_stop=int(stop),
        total_layers=int(total),
        n_embd=llama_cpp.llama_model_n_embd(model),
        n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
    )
    lookahead = read_lookahead_layers(model)
    if shape.n_layers + lookahead != n_layer:
        raise ValueError(f"shard metadata says {shape.n_layers} layers and {lookahead} lookahead, llama.cpp loaded {n_layer}")
    if lookahead and shape.is_last:
        raise ValueError("a last shard cannot have lookahead layers")
    return shape


# ---- the KV cache's size per position -------------------------------------------------------------------------

_GGUF_TYPE_ARRAY = 9
_GGUF_INTEGER_ARRAYS = {0: ctypes.c_uint8, 1: ctypes.c_int8, 2: ctypes.c_uint16, 3: ctypes.c_int16, 4: ctypes.c_uint32, 5: ctypes.c_int32}


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionShape:
    """What llama.cpp sizes a layer's K and V cache rows by: the key and value lengths of a head (the
    GGUF's `attention.key_length` / `value_length`, else n_embd / n_head) and each loaded layer's KV head count
    (`attention.head_count_kv`, a scalar or one entry per layer)."""

    key_length: int
    value_length: int
    head_counts_kv: tuple[int, ...]  # one per layer llama.cpp loaded, lookahead layers included

    def bytes_per_position(self, type_k: int, type_v: int) -> int:
        """K and V bytes one position takes in every layer's cache, K of type `type_k`, V of `type_v` (ggml types)."""
        return sum(
            row_bytes(type_k, self.key_length * heads) + row_bytes(type_v, self.value_length * heads)
            for heads in self.head_counts_kv
        )


def row_bytes(ggml_type: int, elements: int) -> int:
    """ggml_row_size: the bytes of a row of `elements` values of a (possibly block-quantized) ggml type."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    if elements % block_size:
        raise ValueError(f"a row of {elements} values does not fill {gguf.GGMLQuantizationType(ggml_type).name} blocks of {block_size}")
    return elements // block_size * type_size


def read_attention_shape(model: llama_cpp.llama_model_p, path: pathlib.Path) -> AttentionShape:
    """The attention shape of a loaded model; a per-layer head count array (which llama.cpp's metadata API
    does not show) is read from the file's header by llama.cpp's own GGUF reader."""
    arch = meta_value(model, "general.architecture") or "llama"
    n_layer = llama_cpp.llama_model_n_layer(model)
    default_length = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
    key_length = int(meta_value(model, f"{arch}.attention.key_length") or default_length)
    value_length = int(meta_value(model, f"{arch}.attention.value_length") or default_length)
    heads = meta_value(model, f"{arch}.attention.head_count_kv")
    if heads is not None:
        head_counts = (int(heads),) * n_layer
    else:
        head_counts = read_integer_array(path, f"{arch}.attention.head_count_kv")
        if len(head_counts) != n_layer:
            raise ValueError(f"{path.name}: {len(head_counts)} KV head counts for {n_layer} layers")
    return AttentionShape(key_length, value_length, head_counts)


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _gguf_api() -> ctypes.CDLL:
    lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    found = [lib_dir / name for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll") if (lib_dir / name).exists()]
    if not found:
        raise ValueError(f"libggml-base not found beside libllama in {lib_dir}")
    ggml = ctypes.CDLL(str(found[0]))
    ggml.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    ggml.gguf_init_from_file.restype = ctypes.c_void_p
    ggml.gguf_free.argtypes = [ctypes.c_void_p]
    ggml.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.gguf_find_key.restype = ctypes.c_int64
    for name in ("gguf_get_kv_type", "gguf_get_arr_type"):
        getattr(ggml, name).argtypes = [ctypes.c_void_p, ctypes.c_int64]
        getattr(ggml, name).restype = ctypes.c_int
    ggml.gguf_get_arr_n.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    ggml.gguf_get_arr_n.restype = ctypes.c_size_t
    ggml.gguf_get_arr_data.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    ggml.gguf_get_arr_data.restype = ctypes.c_void_p
    return ggml


def read_integer_array(path: pathlib.Path, key: str) -> tuple[int, ...]:
    """The integer array `key` of a GGUF's header, read by ggml's GGUF reader (metadata only, no tensor data)."""
    ggml = _gguf_api()
    context = ggml.gguf_init_from_file(os.fsencode(path), _GgufInitParams(True, None))
    if not context:
        raise ValueError(f"ggml cannot read the GGUF header of {path}")
    try:
        key_id = ggml.gguf_find_key(context, key.encode())
        if key_id < 0 or ggml.gguf_get_kv_type(context, key_id) != _GGUF_TYPE_ARRAY:
            raise ValueError(f"{path.name} has no array {key}")
        element = _GGUF_INTEGER_ARRAYS.get(ggml.gguf_get_arr_type(context, key_id))
        if element is None:
            raise ValueError(f"{path.name}: {key} is not an array of integers")
        length = ggml.gguf_get_arr_n(context, key_id)
        values = (element * length).from_address(ggml.gguf_get_arr_data(context, key_id))
        return tuple(int(value) for value in values)
    finally:
        ggml.gguf_free(context)

"""Where a loaded shard sits in the whole model (its ShardShape), read from the GGUF by llama.cpp itself."""

from __future__ import annotations

import ctypes

import llama_cpp

from kvpool.shard_shape import ShardShape

META_PREFIX = "kvpool.shard."


def meta_value(model: llama_cpp.llama_model_p, key: str) -> str | None:
    buffer = ctypes.create_string_buffer(256)
    written = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, ctypes.sizeof(buffer))
    return buffer.value.decode() if written >= 0 else None


def read_layout(model: llama_cpp.llama_model_p) -> ShardShape:
    n_layer = llama_cpp.llama_model_n_layer(model)
    vocab = llama_cpp.llama_model_get_vocab(model)
    start = meta_value(model, META_PREFIX + "layer_start")
    stop = meta_value(model, META_PREFIX + "layer_stop")
    total = meta_value(model, META_PREFIX + "total_layers")
    if start is None or stop is None or total is None:
        start, stop, total = "0", str(n_layer), str(n_layer)
    layout = ShardShape(
        layer_start=int(start),
        layer_stop=int(stop),
        total_layers=int(total),
        n_embd=llama_cpp.llama_model_n_embd(model),
        n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
    )
    if layout.n_layers != n_layer:
        raise ValueError(f"shard metadata says {layout.n_layers} layers, llama.cpp loaded {n_layer}")
    return layout

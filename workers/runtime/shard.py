"""Where a loaded shard sits in the whole model (its ShardShape), read from the GGUF by llama.cpp itself."""

from __future__ import annotations

import ctypes

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
    lookahead = read_lookahead_layers(model)
    if layout.n_layers + lookahead != n_layer:
        raise ValueError(f"shard metadata says {layout.n_layers} layers and {lookahead} lookahead, llama.cpp loaded {n_layer}")
    if lookahead and layout.is_last:
        raise ValueError("a last shard cannot have lookahead layers")
    return layout

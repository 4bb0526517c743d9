"""Where a shard sits in the whole model, read from the loaded GGUF by llama.cpp itself."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp

META_PREFIX = "kvpool.shard."


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where this shard sits in the whole model, read from the GGUF by llama.cpp itself."""

    layer_start: int
    layer_stop: int
    total_layers: int
    n_embd: int
    n_vocab: int

    @property
    def n_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_stop == self.total_layers


def meta_value(model: llama_cpp.llama_model_p, key: str) -> str | None:
    buffer = ctypes.create_string_buffer(256)
    written = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, ctypes.sizeof(buffer))
    return buffer.value.decode() if written >= 0 else None


def read_layout(model: llama_cpp.llama_model_p) -> ShardLayout:
    n_layer = llama_cpp.llama_model_n_layer(model)
    vocab = llama_cpp.llama_model_get_vocab(model)
    start = meta_value(model, META_PREFIX + "layer_start")
    stop = meta_value(model, META_PREFIX + "layer_stop")
    total = meta_value(model, META_PREFIX + "total_layers")
    if start is None or stop is None or total is None:
        start, stop, total = "0", str(n_layer), str(n_layer)
    layout = ShardLayout(
        layer_start=int(start),
        layer_stop=int(stop),
        total_layers=int(total),
        n_embd=llama_cpp.llama_model_n_embd(model),
        n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
    )
    if layout.n_layers != n_layer:
        raise ValueError(f"shard metadata says {layout.n_layers} layers, llama.cpp loaded {n_layer}")
    return layout

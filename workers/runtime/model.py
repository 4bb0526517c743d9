"""Run one shard (a contiguous layer range of a llama GGUF) with stock llama.cpp.

`ShardModel` owns the loaded weights; `ShardContext` owns one bounded llama context (one sequence)
on it. The first shard takes token ids, later shards take the previous shard's hidden states;
non-final shards return the residual stream after their last local layer (captured by the C eval
callback, which stops the graph there so the vocabulary head never runs), the final shard returns
logits. Hidden states are float32 [n_rows, n_embd] everywhere.
"""

from __future__ import annotations

import os
import pathlib

import llama_cpp

from workers.runtime.context import ShardContext
from workers.runtime.huge_pages import Collapse, MappingWatch
from workers.runtime.native import NativeLibrary, load_native
from workers.runtime.params import Closable, LlamaContext
from workers.runtime.shard import read_attention_shape, read_lookahead_layers, read_shape


class ShardModel:
    """One loaded shard. Load once per process; contexts come and go on it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_threads: int = 1,
        n_gpu_layers: int = 0,
        flash_attn: bool = False,
        verbose: bool = False,
        native: NativeLibrary | None = None,
        huge_pages: bool = True,
    ) -> None:
        """`huge_pages`: the load's own memory collapsed into transparent huge pages (workers.runtime.huge_pages;
        `self.huge_pages` says what came of it). A daemon's workers follow --huge-pages; every other load, the
        bench's references among them, does as they do by default."""
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"shard file not found: {self.path}")
        if n_threads < 1:
            raise ValueError("n_threads must be at least 1")
        self.n_threads = n_threads
        self.flash_attn = flash_attn
        self.verbose = verbose
        self._native = native if native is not None else load_native()
        self._native.set_log_verbose(verbose)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_mmap = True
        watch = MappingWatch(huge_pages)
        model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not load {self.path}")
        self._model: llama_cpp.llama_model_p | None = model
        try:
            self.huge_pages: Collapse = watch.collapse()
            self.shape = read_shape(model)
            self.lookahead_layers = read_lookahead_layers(model)  # loaded after the range, never run
        except Exception:
            self.close()
            raise
        self._live_contexts: set[Closable] = set()  # the owners of the llama contexts open on this model

    @property
    def handle(self) -> llama_cpp.llama_model_p:
        if self._model is None:
            raise RuntimeError("shard model is closed")
        return self._model

    @property
    def native(self) -> NativeLibrary:
        return self._native

    def kv_bytes_per_position(self) -> int:
        """KV cache bytes per position of every layer llama.cpp allocates a cache for (the shard's own layers
        and its lookahead layer, if any), from the model's key/value lengths and per-layer KV head counts, in
        the cache types of kvpool's contexts (workers.runtime.params leaves type_k/type_v at llama.cpp's defaults)."""
        defaults = llama_cpp.llama_context_default_params()
        return read_attention_shape(self.handle, self.path).bytes_per_position(defaults.type_k, defaults.type_v)

    def new_context(
        self, n_ctx: int, *, n_batch: int = 512, abort_flag_address: int | None = None
    ) -> ShardContext:
        return ShardContext(self, n_ctx, n_batch=n_batch, abort_flag_address=abort_flag_address)

    def open_context(
        self, owner: Closable, *, n_ctx: int, n_batch: int, n_seq_max: int, abort_flag_address: int | None
    ) -> LlamaContext:
        """The one way a context (ShardContext, BatchedShardContext) gets its llama context: made with the
        parameters of workers.runtime.params, and `owner` closed by this model before it frees itself."""
        context = LlamaContext(self, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, abort_flag_address=abort_flag_address)
        self._live_contexts.add(owner)
        return context

    def forget(self, owner: Closable) -> None:
        """`owner` freed its llama context itself."""
        self._live_contexts.discard(owner)

    def close(self) -> None:
        """Idempotent; frees every context on this model before the model itself."""
        for context in list(getattr(self, "_live_contexts", ())):
            context.close()
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> ShardModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

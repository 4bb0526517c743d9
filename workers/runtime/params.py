"""A llama context as every kvpool context creates it: one place for its parameters and its creation, so a
single-sequence context and a batched one compute alike (logits are only bit-identical between contexts with
the same choices).

They take the model as a LoadedShard, and so do ShardContext and BatchedShardContext: the model
(workers.runtime.model.ShardModel) opens their llama contexts and frees them before itself, so it sits above
them and none of them imports it back.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import llama_cpp

from kvpool.wire.shape import ShardShape
from workers.runtime.native import NativeLibrary


class LoadedShard(Protocol):
    """What a context takes of the loaded shard it runs on (workers.runtime.model.ShardModel)."""

    shape: ShardShape
    lookahead_layers: int  # loaded after the shard's range, never run
    n_threads: int
    flash_attn: bool

    @property
    def handle(self) -> llama_cpp.llama_model_p: ...

    @property
    def native(self) -> NativeLibrary: ...

    def open_context(self, owner: Closable, *, n_ctx: int, n_batch: int, n_seq_max: int, abort_flag_address: int | None) -> LlamaContext:
        """A LlamaContext for `owner`, which the model closes before it frees itself."""

    def forget(self, owner: Closable) -> None:
        """`owner` closed its LlamaContext: the model no longer closes it."""


class Closable(Protocol):
    def close(self) -> None: ...


class GraphHooks:
    """What a context's graph is run with besides its parameters: the abort flag (an int32 that another
    process, the supervisor, may set through shared memory; the context's own when none is given) and,
    on every shard but the last, the capture state that copies out the last local layer and stops there."""

    def __init__(self, model: LoadedShard, abort_flag_address: int | None) -> None:
        self.own_abort_flag = ctypes.c_int32(0)
        self.abort_flag_address = abort_flag_address if abort_flag_address is not None else ctypes.addressof(self.own_abort_flag)
        shape = model.shape
        self.capture = None if shape.is_last else model.native.new_capture_state(f"l_out-{shape.n_layers - 1}", stop_after=True)


def context_params(model: LoadedShard, *, n_ctx: int, n_batch: int, n_seq_max: int, abort_flag_address: int, capture) -> llama_cpp.llama_context_params:
    """n_batch = n_ubatch (one llama_decode is one micro-batch); the abort callback reads the int32 at
    abort_flag_address; `capture` (a native capture state, or None on the last shard) stops the graph."""
    native = model.native
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = n_seq_max
    if n_seq_max > 1:
        params.kv_unified = False  # a KV stream per sequence: no cell serves another
    params.n_threads = model.n_threads
    params.n_threads_batch = model.n_threads
    params.no_perf = True
    # Explicit, never "auto": logits are only bit-identical between contexts with the same choice.
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if model.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.abort_callback = llama_cpp.ggml_abort_callback(native.abort_callback.value)
    params.abort_callback_data = ctypes.c_void_p(abort_flag_address)
    if capture is not None:
        params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(native.eval_callback.value)
        params.cb_eval_user_data = ctypes.cast(ctypes.pointer(capture), ctypes.c_void_p)
    return params


class LlamaContext:
    """One llama context handle of kvpool's parameters on a loaded shard, with the graph hooks it runs with
    (kept alive as long as the handle). `close()` is idempotent."""

    def __init__(self, model: LoadedShard, *, n_ctx: int, n_batch: int, n_seq_max: int, abort_flag_address: int | None) -> None:
        self.hooks = GraphHooks(model, abort_flag_address)
        params = context_params(
            model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
            abort_flag_address=self.hooks.abort_flag_address, capture=self.hooks.capture,
        )
        handle = llama_cpp.llama_init_from_model(model.handle, params)
        if not handle:
            raise MemoryError(f"llama.cpp could not create a context of {n_ctx} positions for {n_seq_max} sequence(s)")
        self._handle: llama_cpp.llama_context_p | None = handle
        self.memory = llama_cpp.llama_get_memory(handle)

    @property
    def handle(self) -> llama_cpp.llama_context_p:
        if self._handle is None:
            raise RuntimeError("context is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        if self._handle is not None:
            llama_cpp.llama_free(self._handle)
            self._handle = None

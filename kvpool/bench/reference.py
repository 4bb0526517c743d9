"""llama.cpp in-process with no kvpool code, the references: one plain context, and one batched context
serving several sequences."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp
import numpy as np

from workers.runtime.model import ShardModel

# ---- llama.cpp in-process, no kvpool code: the references -------------------------------------------


class PlainContext:
    """llama.cpp on one model file with no eval callback: one sequence, last-row output, like any app."""

    def __init__(self, model: ShardModel, n_ctx: int, *, n_threads: int, n_batch: int = 512) -> None:
        self.shape = model.shape
        self.n_batch = min(n_batch, n_ctx)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self.ctx:
            raise MemoryError(f"llama.cpp could not create a context of n_ctx {n_ctx}")
        self.takes_tokens = self.shape.is_first
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0 if self.takes_tokens else self.shape.n_embd, 1)
        if self.takes_tokens:
            self.rows = np.ctypeslib.as_array(self.batch.token, shape=(self.n_batch,))
        else:
            self.rows = np.ctypeslib.as_array(self.batch.embd, shape=(self.n_batch, self.shape.n_embd))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(self.n_batch,))
        self.outputs = np.ctypeslib.as_array(self.batch.logits, shape=(self.n_batch,))
        for row in range(self.n_batch):
            self.batch.n_seq_id[row] = 1
            self.batch.seq_id[row][0] = 0
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def reset(self) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, 0, 0, -1)

    def append(self, start_pos: int, rows: np.ndarray) -> np.ndarray | None:
        """Last row's logits (a view into llama.cpp's buffer) on a last shard, else None."""
        for chunk in range(0, len(rows), self.n_batch):
            part = rows[chunk : chunk + self.n_batch]
            count = len(part)
            self.rows[:count] = part
            self.pos[:count] = np.arange(start_pos + chunk, start_pos + chunk + count, dtype=np.int32)
            self.outputs[:count] = 0
            self.outputs[count - 1] = 1
            self.batch.n_tokens = count
            status = llama_cpp.llama_decode(self.ctx, self.batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
        if not self.shape.is_last:
            return None
        logits = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(1, self.shape.n_vocab))

    def save_state(self) -> ctypes.Array:
        """The sequence's state (llama_state_seq_get_data) in native memory, where a llama.cpp app (its server's
        prompt cache) keeps a prompt it reuses."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, 0)
        state = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(self.ctx, state, size, 0) != size:
            raise RuntimeError("llama_state_seq_get_data wrote a short state")
        return state

    def restore_state(self, state: ctypes.Array, length: int) -> None:
        """Empty the sequence and load a saved state into it (llama_state_seq_set_data), in this context:
        what llama.cpp's server does when a slot takes a cached prompt. Raises unless it holds `length` positions."""
        llama_cpp.llama_memory_seq_rm(self.memory, 0, 0, -1)
        if llama_cpp.llama_state_seq_set_data(self.ctx, state, len(state), 0) == 0:
            raise RuntimeError("llama_state_seq_set_data refused the state")
        held = llama_cpp.llama_memory_seq_pos_max(self.memory, 0) + 1
        if held != length:
            raise RuntimeError(f"the restored sequence holds {held} positions, {length} expected")

    def close(self) -> None:
        if self.ctx is not None:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


class BatchedContext:
    """llama.cpp's own way to serve several sessions: one context, one sequence each, and one
    llama_decode per step with one row per sequence (what llama.cpp's server does with -np 4)."""

    def __init__(self, model: ShardModel, n_seq: int, n_ctx_per_seq: int, *, n_threads: int, unified: bool) -> None:
        self.n_vocab = model.shape.n_vocab
        self.n_seq = n_seq
        self.n_batch = 512
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx_per_seq * n_seq
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = n_seq
        params.kv_unified = unified
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self.ctx:
            raise MemoryError("llama.cpp could not create the batched context")
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(self.n_batch,))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(self.n_batch,))
        self.outputs = np.ctypeslib.as_array(self.batch.logits, shape=(self.n_batch,))
        self.seq = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(self.n_batch,))
        self.seq[:] = 1
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def _decode(self, count: int) -> None:
        self.batch.n_tokens = count
        status = llama_cpp.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _greedy(self, row: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))))

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """Every prompt in one batch (as the server does); the first greedy token of each."""
        last_rows = []
        row = 0
        for seq, prompt in enumerate(prompts):
            llama_cpp.llama_memory_seq_rm(self.memory, seq, 0, -1)
            for position, token in enumerate(prompt):
                self.tokens[row], self.pos[row], self.outputs[row] = token, position, 0
                self.batch.seq_id[row][0] = seq
                row += 1
            self.outputs[row - 1] = 1
            last_rows.append(row - 1)
        self._decode(row)
        return [self._greedy(index) for index in last_rows]

    def step(self, tokens: Sequence[int], positions: Sequence[int]) -> list[int]:
        """One decode step of every sequence: one llama_decode of n_seq rows; the next greedy tokens."""
        for seq, (token, position) in enumerate(zip(tokens, positions)):
            self.tokens[seq], self.pos[seq], self.outputs[seq] = token, position, 1
            self.batch.seq_id[seq][0] = seq
        self._decode(len(tokens))
        return [self._greedy(seq) for seq in range(len(tokens))]

    def step_alone(self, seq: int, token: int, position: int) -> int:
        """One decode step of sequence `seq` alone: one llama_decode of 1 row in the same context (the
        reference's own one-row cost, which its n_seq-row step must not exceed n_seq times); the next token."""
        self.tokens[0], self.pos[0], self.outputs[0] = token, position, 1
        self.batch.seq_id[0][0] = seq
        self._decode(1)
        return self._greedy(0)

    def close(self) -> None:
        if self.ctx is not None:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

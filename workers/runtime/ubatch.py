"""The llama_batch of a BatchedShardContext (workers.runtime.batched) and one llama_decode of one planned ubatch
(workers.runtime.batch_plan): the items' rows laid into the batch, which rows produce output, and each item's
hidden states (captured on a non-final shard) or logits scattered back into its own output array."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from workers.runtime.batch_plan import SeqAppend, UbatchSlice

if TYPE_CHECKING:
    from workers.runtime.model import ShardModel

DECODE_ABORTED = 2


class UbatchDecoder:
    """Owns the llama_batch of n_batch rows and the views into it; `close()` frees it (idempotent)."""

    def __init__(self, model: ShardModel, n_batch: int, capture) -> None:
        self._model = model
        self.shape = model.shape
        self.n_batch = n_batch
        self.decode_calls = 0  # llama_decode calls so far (read by tests, and by a canceller mid-append)
        self._capture = capture  # the native capture state of a non-final shard; None on the last
        takes_tokens = self.shape.is_first
        self._batch: llama_cpp.llama_batch | None = llama_cpp.llama_batch_init(n_batch, 0 if takes_tokens else self.shape.n_embd, 1)
        batch = self._batch
        self._batch_pos = np.ctypeslib.as_array(batch.pos, shape=(n_batch,))
        self._batch_outputs = np.ctypeslib.as_array(batch.logits, shape=(n_batch,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n_batch,))[:] = 1
        self._row_seq = [
            np.ctypeslib.as_array(batch.seq_id[row], shape=(1,)) for row in range(n_batch)
        ]
        if takes_tokens:
            self._batch_tokens = np.ctypeslib.as_array(batch.token, shape=(n_batch,))
        else:
            self._batch_embd = np.ctypeslib.as_array(batch.embd, shape=(n_batch, self.shape.n_embd))
        self._captured = np.empty((n_batch if capture is not None else 0, self.shape.n_embd), np.float32)

    def decode(
        self,
        ctx: llama_cpp.llama_context_p,
        ubatch: list[UbatchSlice],
        items: list[SeqAppend],
        rows: list[np.ndarray],
        outputs: list[np.ndarray],
    ) -> str | None:
        """One llama_decode of one ubatch, its rows scattered into `outputs`; None, or what failed."""
        shape = self.shape
        batch = self._batch
        assert batch is not None
        offset = 0
        for piece in ubatch:
            item = items[piece.item]
            count = piece.row_stop - piece.row_start
            stop = offset + count
            if shape.is_first:
                self._batch_tokens[offset:stop] = rows[piece.item][piece.row_start : piece.row_stop]
            else:
                self._batch_embd[offset:stop] = rows[piece.item][piece.row_start : piece.row_stop]
            first_pos = item.start_pos + piece.row_start
            self._batch_pos[offset:stop] = np.arange(first_pos, first_pos + count, dtype=np.int32)
            for row in range(offset, stop):
                self._row_seq[row][0] = piece.seq
            if shape.is_last and item.output_rows == "last":
                self._batch_outputs[offset:stop] = 0
                if piece.row_stop == rows[piece.item].shape[0]:
                    self._batch_outputs[stop - 1] = 1
            elif not shape.is_last and self._model.lookahead_layers:
                # Pruning to the marked rows happens in the lookahead layer, which never runs (see
                # workers/runtime/context.py): one output for the whole ubatch, marked below.
                self._batch_outputs[offset:stop] = 0
            else:
                # Non-final shards mark every row: llama.cpp prunes unmarked rows in the last layer.
                self._batch_outputs[offset:stop] = 1
            offset = stop
        if not shape.is_last and self._model.lookahead_layers:
            self._batch_outputs[offset - 1] = 1
        batch.n_tokens = offset
        capture = self._capture
        if capture is not None:
            capture.dst = self._captured.ctypes.data
            capture.dst_capacity = offset * shape.n_embd * 4
            capture.captured_bytes = 0
            capture.overflow = 0
        status = llama_cpp.llama_decode(ctx, batch)
        self.decode_calls += 1
        if status == DECODE_ABORTED:
            return "append cancelled"
        if status != 0:
            return f"llama_decode returned {status}"
        if capture is not None and (capture.overflow or capture.captured_bytes != offset * shape.n_embd * 4):
            return f"captured {capture.captured_bytes} bytes for {offset} rows"
        # One ubatch of consecutive sequences in increasing order: llama.cpp keeps the batch order.
        offset = 0
        for piece in ubatch:
            count = piece.row_stop - piece.row_start
            out = outputs[piece.item]
            if capture is not None:
                out[piece.row_start : piece.row_stop] = self._captured[offset : offset + count]
            elif items[piece.item].output_rows == "all":
                for row in range(count):
                    source = llama_cpp.llama_get_logits_ith(ctx, offset + row)
                    ctypes.memmove(out[piece.row_start + row].ctypes.data, source, shape.n_vocab * 4)
            elif piece.row_stop == rows[piece.item].shape[0]:
                source = llama_cpp.llama_get_logits_ith(ctx, offset + count - 1)
                ctypes.memmove(out.ctypes.data, source, shape.n_vocab * 4)
            offset += count
        return None

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None

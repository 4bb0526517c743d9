"""Several sequences in one bounded llama context on a loaded shard: the groundwork of batched mode.

One context with `n_seq_max = n_seqs` and `kv_unified = false`: every sequence has its own KV stream of
`n_ctx_per_seq` positions, so one sequence's cells never serve another. Appends of several sequences
are decoded together; each item gets back only its own rows (hidden states on a non-final shard,
logits on the last).

How llama.cpp 0.3.36 batches them (src/llama-kv-cache.cpp, src/llama-batch.cpp): with more than one
KV stream a batch is cut by `split_equal(n_ubatch, sequential=true)` into micro-batches ("ubatches")
of *consecutive* sequence ids, each contributing the *same* number of rows, laid out sequence by
sequence; a 10-row prefill beside a 1-row decode would have its first row computed apart from the
other nine. This module cuts the calls itself (`plan_ubatches`) so that each `llama_decode` is exactly
one ubatch: the capture callback then sees every row of the call once, in batch order, and each
sequence keeps the row partition of its own append. Appends of equal row counts on consecutive
sequence ids that fit n_batch (a decode step of every session) are one `llama_decode`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from workers.batch_plan import SeqAppend, UbatchSlice, plan_ubatches
from workers.context_params import context_params
from workers.errors import (
    BadInput,
    Cancelled,
    ContextFull,
    DecodeFailed,
    PositionMismatch,
    ShardRuntimeError,
)

if TYPE_CHECKING:
    from workers.runtime import ShardModel

DECODE_ABORTED = 2
MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ in llama.cpp


def _with_lengths(error: ShardRuntimeError, lengths: dict[int, int]) -> ShardRuntimeError:
    error.lengths = lengths  # type: ignore[attr-defined]
    return error


class BatchedShardContext:
    """One bounded llama context holding up to `n_seqs` isolated sequences for this shard's layers.

    Errors are the typed ones of `ShardContext`: `length` is the length of the sequence the error is
    about (a failed decode: the first item's), and `lengths` maps every valid sequence the call named to
    its length after the call. A failed call leaves every sequence as it was before it.
    """

    def __init__(
        self,
        model: ShardModel,
        n_ctx_per_seq: int,
        n_seqs: int,
        *,
        n_batch: int,
        abort_flag_address: int | None = None,
    ) -> None:
        if n_ctx_per_seq < 1:
            raise ValueError("n_ctx_per_seq must be at least 1")
        if not 1 <= n_seqs <= MAX_SEQUENCES:
            raise ValueError(f"n_seqs must be in [1, {MAX_SEQUENCES}]")
        self._model = model
        self.layout = model.layout
        self.n_ctx_per_seq = n_ctx_per_seq
        self.n_seqs = n_seqs
        self.n_batch = max(1, min(n_batch, n_ctx_per_seq * n_seqs))
        self._lengths = [0] * n_seqs
        self.decode_calls = 0  # llama_decode calls so far (read by tests, and by a canceller mid-append)
        self._ctx: llama_cpp.llama_context_p | None = None
        self._batch: llama_cpp.llama_batch | None = None
        native = model.native
        self._own_abort_flag = ctypes.c_int32(0)
        self.abort_flag_address = (
            abort_flag_address if abort_flag_address is not None else ctypes.addressof(self._own_abort_flag)
        )
        self._capture = None
        if not self.layout.is_last:
            self._capture = native.new_capture_state(f"l_out-{self.layout.n_layers - 1}", stop_after=True)

        # llama.cpp gives each of the n_seq_max streams n_ctx / n_seq_max cells, padded up to 256.
        params = context_params(
            model, n_ctx=n_ctx_per_seq * n_seqs, n_batch=self.n_batch, n_seq_max=n_seqs,
            abort_flag_address=self.abort_flag_address, capture=self._capture,
        )
        ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not ctx:
            raise MemoryError(f"llama.cpp could not create a context of {n_seqs} x {n_ctx_per_seq} positions")
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.n_ctx_seq_allocated = llama_cpp.llama_n_ctx_seq(ctx)
        model._live_contexts.add(self)  # type: ignore[arg-type]  # freed before the model, like ShardContext

        takes_tokens = self.layout.is_first
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0 if takes_tokens else self.layout.n_embd, 1)
        batch = self._batch
        self._batch_pos = np.ctypeslib.as_array(batch.pos, shape=(self.n_batch,))
        self._batch_outputs = np.ctypeslib.as_array(batch.logits, shape=(self.n_batch,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(self.n_batch,))[:] = 1
        self._row_seq = [
            np.ctypeslib.as_array(batch.seq_id[row], shape=(1,)) for row in range(self.n_batch)
        ]
        if takes_tokens:
            self._batch_tokens = np.ctypeslib.as_array(batch.token, shape=(self.n_batch,))
        else:
            self._batch_embd = np.ctypeslib.as_array(batch.embd, shape=(self.n_batch, self.layout.n_embd))
        self._captured = np.empty((self.n_batch if self._capture is not None else 0, self.layout.n_embd), np.float32)

    @property
    def closed(self) -> bool:
        return self._ctx is None

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self._lengths)

    def length(self, seq: int) -> int:
        self._check_seq(seq)
        return self._lengths[seq]

    def _handle(self) -> llama_cpp.llama_context_p:
        if self._ctx is None:
            raise RuntimeError("context is closed")
        return self._ctx

    def _check_seq(self, seq: object) -> int:
        if not isinstance(seq, (int, np.integer)) or isinstance(seq, bool) or not 0 <= seq < self.n_seqs:
            raise BadInput(f"sequence must be an int in [0, {self.n_seqs}), not {seq!r}", length=0)
        return int(seq)

    def _validate_rows(self, rows: object, length: int) -> np.ndarray:
        if self.layout.is_first:
            array = np.asarray(rows)
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise BadInput("the first shard takes a 1-D sequence of token ids", length=length)
            if array.size and (array.min() < 0 or array.max() >= self.layout.n_vocab):
                raise BadInput(f"token ids must be in [0, {self.layout.n_vocab})", length=length)
            return array.astype(np.int32, copy=False)
        array = np.asarray(rows)
        if array.dtype != np.float32 or array.ndim != 2 or array.shape[1] != self.layout.n_embd:
            raise BadInput(
                f"hidden states must be float32 [n_rows, {self.layout.n_embd}], got {array.dtype} {array.shape}",
                length=length,
            )
        return np.ascontiguousarray(array)

    def _validate(self, items: Sequence[SeqAppend]) -> list[np.ndarray]:
        seen: set[int] = set()
        validated = []
        for item in items:
            seq = self._check_seq(item.seq)
            length = self._lengths[seq]
            if seq in seen:
                raise BadInput(f"sequence {seq} named twice in one call", length=length)
            seen.add(seq)
            if item.start_pos != length:
                raise PositionMismatch(f"sequence {seq}: start_pos {item.start_pos} != length {length}", length=length)
            if item.output_rows not in ("last", "all"):
                raise BadInput(f"output_rows must be 'last' or 'all', not {item.output_rows!r}", length=length)
            rows = self._validate_rows(item.rows, length)
            if rows.shape[0] == 0:
                raise BadInput("an append needs at least one row", length=length)
            if length + rows.shape[0] > self.n_ctx_per_seq:
                raise ContextFull(
                    f"sequence {seq}: {length} + {rows.shape[0]} rows exceed n_ctx_per_seq {self.n_ctx_per_seq}",
                    length=length,
                )
            validated.append(rows)
        return validated

    def append_many(self, items: Iterable[SeqAppend | tuple]) -> list[np.ndarray]:
        """Append each item's rows to its sequence (one item per sequence), in the calls of `plan_ubatches`.

        Returns, in item order, hidden states of every row (non-final shard) or logits of the last row /
        all rows (final shard). Validation is all-or-nothing; on a failed or cancelled decode every named
        sequence is rolled back to its length before this call.
        """
        ctx = self._handle()
        try:
            items = [SeqAppend(*item) for item in items]
        except TypeError as error:
            raise BadInput(f"an item is (seq, start_pos, rows[, output_rows]): {error}", length=0) from None
        if not items:
            raise BadInput("append_many needs at least one item", length=0)
        try:
            rows = self._validate(items)
        except ShardRuntimeError as error:
            raise _with_lengths(error, {seq: self._lengths[seq] for seq in self._named(items)}) from None
        before = {item.seq: self._lengths[item.seq] for item in items}
        layout = self.layout
        outputs = []
        for item, item_rows in zip(items, rows):
            n_rows = item_rows.shape[0]
            if layout.is_last:
                outputs.append(np.empty((n_rows if item.output_rows == "all" else 1, layout.n_vocab), np.float32))
            else:
                outputs.append(np.empty((n_rows, layout.n_embd), np.float32))
        plan = plan_ubatches([item.seq for item in items], [r.shape[0] for r in rows], self.n_batch)
        for ubatch in plan:
            failure = self._decode_ubatch(ctx, ubatch, items, rows, outputs)
            if failure is not None:
                self._roll_back(before)
                error_type = Cancelled if failure == "append cancelled" else DecodeFailed
                raise _with_lengths(error_type(failure, length=before[items[0].seq]), dict(before))
        for item, item_rows in zip(items, rows):
            self._lengths[item.seq] = item.start_pos + item_rows.shape[0]
        return outputs

    def _named(self, items: Sequence[SeqAppend]) -> list[int]:
        named = []
        for item in items:
            try:
                named.append(self._check_seq(item.seq))
            except BadInput:
                pass
        return named

    def _decode_ubatch(
        self,
        ctx: llama_cpp.llama_context_p,
        ubatch: list[UbatchSlice],
        items: list[SeqAppend],
        rows: list[np.ndarray],
        outputs: list[np.ndarray],
    ) -> str | None:
        """One llama_decode of one ubatch, its rows scattered into `outputs`; None, or what failed."""
        layout = self.layout
        batch = self._batch
        assert batch is not None
        offset = 0
        for piece in ubatch:
            item = items[piece.item]
            count = piece.row_stop - piece.row_start
            stop = offset + count
            if layout.is_first:
                self._batch_tokens[offset:stop] = rows[piece.item][piece.row_start : piece.row_stop]
            else:
                self._batch_embd[offset:stop] = rows[piece.item][piece.row_start : piece.row_stop]
            first_pos = item.start_pos + piece.row_start
            self._batch_pos[offset:stop] = np.arange(first_pos, first_pos + count, dtype=np.int32)
            for row in range(offset, stop):
                self._row_seq[row][0] = piece.seq
            if layout.is_last and item.output_rows == "last":
                self._batch_outputs[offset:stop] = 0
                if piece.row_stop == rows[piece.item].shape[0]:
                    self._batch_outputs[stop - 1] = 1
            elif not layout.is_last and self._model.lookahead_layers:
                # Pruning to the marked rows happens in the lookahead layer, which never runs (see
                # workers/context.py): one output for the whole ubatch, marked below.
                self._batch_outputs[offset:stop] = 0
            else:
                # Non-final shards mark every row: llama.cpp prunes unmarked rows in the last layer.
                self._batch_outputs[offset:stop] = 1
            offset = stop
        if not layout.is_last and self._model.lookahead_layers:
            self._batch_outputs[offset - 1] = 1
        batch.n_tokens = offset
        capture = self._capture
        if capture is not None:
            capture.dst = self._captured.ctypes.data
            capture.dst_capacity = offset * layout.n_embd * 4
            capture.captured_bytes = 0
            capture.overflow = 0
        status = llama_cpp.llama_decode(ctx, batch)
        self.decode_calls += 1
        if status == DECODE_ABORTED:
            return "append cancelled"
        if status != 0:
            return f"llama_decode returned {status}"
        if capture is not None and (capture.overflow or capture.captured_bytes != offset * layout.n_embd * 4):
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
                    ctypes.memmove(out[piece.row_start + row].ctypes.data, source, layout.n_vocab * 4)
            elif piece.row_stop == rows[piece.item].shape[0]:
                source = llama_cpp.llama_get_logits_ith(ctx, offset + count - 1)
                ctypes.memmove(out.ctypes.data, source, layout.n_vocab * 4)
            offset += count
        return None

    def _roll_back(self, lengths: dict[int, int]) -> None:
        # Ubatches finished before a failure stay in the KV cache: remove them, sequence by sequence.
        for seq, length in lengths.items():
            llama_cpp.llama_memory_seq_rm(self._memory, seq, length, -1)
            self._lengths[seq] = llama_cpp.llama_memory_seq_pos_max(self._memory, seq) + 1
            if self._lengths[seq] != length:
                raise RuntimeError(f"sequence {seq}: roll back to {length} left {self._lengths[seq]}")

    def truncate(self, seq: int, n: int) -> int:
        """Keep positions [0, n) of one sequence. Returns its new length."""
        self._handle()
        seq = self._check_seq(seq)
        length = self._lengths[seq]
        if not isinstance(n, (int, np.integer)) or not 0 <= n <= length:
            raise PositionMismatch(f"cannot truncate sequence {seq} to {n}: its length is {length}", length=length)
        if n < length:
            self._roll_back({seq: int(n)})
        return self._lengths[seq]

    def clear(self, seq: int) -> None:
        """Empty one sequence; the others are untouched."""
        self.truncate(seq, 0)

    def save_state(self, seq: int) -> bytes:
        """One sequence's KV state (llama_state_seq_get_data). Restores only into a context with the
        same n_seqs (the blob records every stream), into any of its sequences."""
        ctx = self._handle()
        seq = self._check_seq(seq)
        size = llama_cpp.llama_state_seq_get_size(ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, seq)
        if written != size:
            raise DecodeFailed(f"state of sequence {seq}: wrote {written} of {size} bytes", length=self._lengths[seq])
        return bytes(buffer)

    def restore_state(self, seq: int, blob: bytes) -> int:
        """Load a saved sequence into an empty sequence `seq`. Returns its length.

        A failed restore leaves `seq` empty; llama.cpp may then hold corrupt cells in that stream
        (llama.cpp issue 27068), which per-sequence streams keep away from the other sequences.
        """
        ctx = self._handle()
        seq = self._check_seq(seq)
        if self._lengths[seq] != 0:
            length = self._lengths[seq]
            raise PositionMismatch(f"restore needs an empty sequence; {seq} has length {length}", length=length)
        source = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        read = llama_cpp.llama_state_seq_set_data(ctx, source, len(blob), seq)
        pos_min = llama_cpp.llama_memory_seq_pos_min(self._memory, seq)
        length = llama_cpp.llama_memory_seq_pos_max(self._memory, seq) + 1
        if read != len(blob) or length < 1 or pos_min != 0 or length > self.n_ctx_per_seq:
            llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._lengths[seq] = 0
            raise BadInput(f"restoring sequence {seq} failed (read {read} of {len(blob)} bytes)", length=0)
        self._lengths[seq] = length
        return length

    def close(self) -> None:
        """Idempotent; frees the batch and the context (the model stays)."""
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        self._model._forget(self)  # type: ignore[arg-type]

    def __enter__(self) -> BatchedShardContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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

What makes a call valid is workers.runtime.batch_checks; the llama_batch and one ubatch's decode are
workers.runtime.ubatch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llama_cpp
import numpy as np

from workers.runtime.batch_checks import check_seq, named_seqs, validated_appends
from workers.runtime.batch_plan import SeqAppend, plan_ubatches
from workers.runtime.errors import BadInput, Cancelled, DecodeFailed, PositionMismatch, ShardRuntimeError
from workers.runtime.outputs import output_array
from workers.runtime.params import LoadedShard
from workers.runtime.sequence_io import StateSizeMismatch, restore_sequence, save_sequence
from workers.runtime.ubatch import UbatchDecoder

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
        model: LoadedShard,
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
        self.shape = model.shape
        self.n_ctx_per_seq = n_ctx_per_seq
        self.n_seqs = n_seqs
        self.n_batch = max(1, min(n_batch, n_ctx_per_seq * n_seqs))
        self._lengths = [0] * n_seqs
        self._decoder: UbatchDecoder | None = None
        # llama.cpp gives each of the n_seq_max streams n_ctx / n_seq_max cells, padded up to 256.
        self._llama = model.open_context(
            self, n_ctx=n_ctx_per_seq * n_seqs, n_batch=self.n_batch, n_seq_max=n_seqs, abort_flag_address=abort_flag_address
        )
        self.abort_flag_address = self._llama.hooks.abort_flag_address
        self._capture = self._llama.hooks.capture
        self._memory = self._llama.memory
        self.n_ctx_seq_allocated = llama_cpp.llama_n_ctx_seq(self._llama.handle)
        self._decoder = UbatchDecoder(model, self.n_batch, self._capture)

    @property
    def closed(self) -> bool:
        return self._llama.closed

    @property
    def decode_calls(self) -> int:
        """llama_decode calls so far (read by tests, and by a canceller mid-append)."""
        return self._decoder.decode_calls if self._decoder is not None else 0

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self._lengths)

    def length(self, seq: int) -> int:
        check_seq(seq, self.n_seqs)
        return self._lengths[seq]

    def _handle(self) -> llama_cpp.llama_context_p:
        return self._llama.handle

    def append_many(self, items: Iterable[SeqAppend | tuple], outputs: Sequence[np.ndarray | None] | None = None) -> list[np.ndarray]:
        """Append each item's rows to its sequence (one item per sequence), in the calls of `plan_ubatches`.

        Returns, in item order, hidden states of every row (non-final shard) or logits of the last row /
        all rows (final shard), written where `outputs` says (one entry an item: an array of the item's output
        shape, float32 C-contiguous, which the caller keeps; None, or no `outputs`: a new array). Validation is
        all-or-nothing; on a failed or cancelled decode every named sequence is rolled back to its length
        before this call.
        """
        ctx = self._handle()
        try:
            items = [SeqAppend(*item) for item in items]
        except TypeError as error:
            raise BadInput(f"an item is (seq, start_pos, rows[, output_rows]): {error}", length=0) from None
        if not items:
            raise BadInput("append_many needs at least one item", length=0)
        try:
            rows = validated_appends(items, self._lengths, self.n_ctx_per_seq, self.shape)
            outputs = self._output_arrays(items, rows, outputs)
        except ShardRuntimeError as error:
            raise _with_lengths(error, {seq: self._lengths[seq] for seq in named_seqs(items, self.n_seqs)}) from None
        before = {item.seq: self._lengths[item.seq] for item in items}
        plan = plan_ubatches([item.seq for item in items], [r.shape[0] for r in rows], self.n_batch)
        for ubatch in plan:
            failure = self._decoder.decode(ctx, ubatch, items, rows, outputs)
            if failure is not None:
                self._roll_back(before)
                error_type = Cancelled if failure == "append cancelled" else DecodeFailed
                raise _with_lengths(error_type(failure, length=before[items[0].seq]), dict(before))
        for item, item_rows in zip(items, rows):
            self._lengths[item.seq] = item.start_pos + item_rows.shape[0]
        return outputs

    def _output_arrays(self, items: list[SeqAppend], rows: list[np.ndarray], given: Sequence[np.ndarray | None] | None) -> list[np.ndarray]:
        """Each item's output array (append_many's `outputs`): the caller's, checked, one an item and no two
        overlapping (a row written for one item must not land in another's), or new ones."""
        given = [None] * len(items) if given is None else list(given)
        first_length = self._lengths[items[0].seq]
        if len(given) != len(items):
            raise BadInput(f"{len(given)} output buffers for {len(items)} items", length=first_length)
        arrays = [
            output_array(out, self.shape.output_shape(item_rows.shape[0], item.output_rows), length=self._lengths[item.seq])
            for item, item_rows, out in zip(items, rows, given)
        ]
        spans = sorted((array.ctypes.data, array.ctypes.data + array.nbytes) for array, out in zip(arrays, given) if out is not None)
        if any(start < end for (_start, end), (start, _end) in zip(spans, spans[1:])):
            raise BadInput("two items' output buffers overlap", length=first_length)
        return arrays

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
        seq = check_seq(seq, self.n_seqs)
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
        seq = check_seq(seq, self.n_seqs)
        try:
            return save_sequence(ctx, seq)
        except StateSizeMismatch as error:
            raise DecodeFailed(str(error), length=self._lengths[seq]) from None

    def restore_state(self, seq: int, blob: bytes | memoryview) -> int:
        """Load a saved sequence into an empty sequence `seq`. Returns its length.

        A failed restore leaves `seq` empty; llama.cpp may then hold corrupt cells in that stream
        (llama.cpp issue 27068), which per-sequence streams keep away from the other sequences.
        """
        ctx = self._handle()
        seq = check_seq(seq, self.n_seqs)
        if self._lengths[seq] != 0:
            length = self._lengths[seq]
            raise PositionMismatch(f"restore needs an empty sequence; {seq} has length {length}", length=length)
        read = restore_sequence(ctx, seq, blob)
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
        if self._decoder is not None:
            self._decoder.close()
        self._llama.close()
        self._model.forget(self)

    def __enter__(self) -> BatchedShardContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

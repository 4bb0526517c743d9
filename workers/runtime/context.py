"""One bounded llama context on a loaded shard: one sequence's KV cache for the shard's layers.

The first shard takes token ids, later shards take the previous shard's hidden states; non-final shards
return the residual stream after their last local layer (captured by the C eval callback, which stops
the graph there so the vocabulary head never runs), the final shard returns logits.
"""

from __future__ import annotations

import ctypes
from typing import Literal

import llama_cpp
import numpy as np

from kvpool.wire.checks import check_input_kind, check_output_rows, check_position, shard_rows
from workers.runtime.errors import BadInput, Cancelled, DecodeFailed, PositionMismatch, RestoreFailed, wire_checks
from workers.runtime.outputs import output_array
from workers.runtime.params import LoadedShard
from workers.runtime.sequence_io import restore_sequence, save_sequence, save_sequence_to_memfd

OutputRows = Literal["last", "all"]

SEQUENCE = 0
DECODE_ABORTED = 2


class ShardContext:
    """One bounded llama context holding one sequence's KV cache for this shard's layers."""

    def __init__(
        self, model: LoadedShard, n_ctx: int, *, n_batch: int, abort_flag_address: int | None
    ) -> None:
        if n_ctx < 1:
            raise ValueError("n_ctx must be at least 1")
        self._model = model
        self.shape = model.shape
        self.n_ctx = n_ctx
        self.n_batch = max(1, min(n_batch, n_ctx))
        self._length = 0
        self._batch: llama_cpp.llama_batch | None = None
        self._llama = model.open_context(self, n_ctx=n_ctx, n_batch=self.n_batch, n_seq_max=1, abort_flag_address=abort_flag_address)
        self.abort_flag_address = self._llama.hooks.abort_flag_address
        self._capture = self._llama.hooks.capture
        self._memory = self._llama.memory

        takes_tokens = self.shape.is_first
        embd_width = 0 if takes_tokens else self.shape.n_embd
        self._batch = llama_cpp.llama_batch_init(self.n_batch, embd_width, 1)
        batch = self._batch
        self._batch_pos = np.ctypeslib.as_array(batch.pos, shape=(self.n_batch,))
        self._batch_outputs = np.ctypeslib.as_array(batch.logits, shape=(self.n_batch,))
        n_seq_id = np.ctypeslib.as_array(batch.n_seq_id, shape=(self.n_batch,))
        n_seq_id[:] = 1
        for row in range(self.n_batch):
            batch.seq_id[row][0] = SEQUENCE
        if takes_tokens:
            self._batch_tokens = np.ctypeslib.as_array(batch.token, shape=(self.n_batch,))
        else:
            self._batch_embd = np.ctypeslib.as_array(batch.embd, shape=(self.n_batch, self.shape.n_embd))

    @property
    def length(self) -> int:
        return self._length

    @property
    def closed(self) -> bool:
        return self._llama.closed

    def _handle(self) -> llama_cpp.llama_context_p:
        return self._llama.handle

    def _checked_rows(self, start_pos: int, tokens: object, hidden: object, output_rows: object) -> np.ndarray:
        """The append's rows, checked by kvpool.wire.checks as the daemon checks them (BadInput,
        PositionMismatch, ContextFull)."""
        length = self._length
        with wire_checks():
            check_input_kind(self.shape, tokens, hidden, length=length)
            rows = shard_rows(self.shape, tokens if self.shape.is_first else hidden, length=length)
            check_output_rows(output_rows, length=length)
            check_position(start_pos, length, rows.shape[0], self.n_ctx)
        return rows

    def append(
        self,
        start_pos: int,
        *,
        tokens: object = None,
        hidden: object = None,
        output_rows: OutputRows = "last",
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Append rows at start_pos (must equal length). Returns hidden states of every row
        (non-final shard) or logits of the last row / all rows (final shard), written into `out`
        when given (float32, C-contiguous, exactly the result's shape: e.g. a view of shared memory).

        On any failure the context is rolled back to its length before this call.
        """
        self._handle()  # a closed context says so before anything about the rows
        rows = self._checked_rows(start_pos, tokens, hidden, output_rows)
        return self.append_checked(start_pos, rows, output_rows=output_rows, out=out)

    def append_checked(self, start_pos: int, rows: np.ndarray, *, output_rows: OutputRows = "last", out: np.ndarray | None = None) -> np.ndarray:
        """append() of rows that kvpool.wire.checks has already checked against this context as append() would
        (append_rows, check_position: the worker's direct channel, whose request those checks took apart):
        the same append without checking them a second time on a decode step's path (`output_rows` too must be
        "last" or "all": the request's, as msgspec decoded it)."""
        ctx = self._handle()
        n_rows = rows.shape[0]

        shape = self.shape
        out = output_array(out, shape.output_shape(n_rows, output_rows), length=self._length)
        batch = self._batch
        assert batch is not None
        for chunk_start in range(0, n_rows, self.n_batch):
            chunk_stop = min(n_rows, chunk_start + self.n_batch)
            chunk_rows = chunk_stop - chunk_start
            if shape.is_first:
                self._batch_tokens[:chunk_rows] = rows[chunk_start:chunk_stop]
            else:
                self._batch_embd[:chunk_rows] = rows[chunk_start:chunk_stop]
            if chunk_rows == 1:  # a decode step: no array made for one position
                self._batch_pos[0] = start_pos + chunk_start
            else:
                self._batch_pos[:chunk_rows] = np.arange(start_pos + chunk_start, start_pos + chunk_stop, dtype=np.int32)
            if shape.is_last and output_rows == "last":
                self._batch_outputs[:chunk_rows] = 0
                if chunk_stop == n_rows:
                    self._batch_outputs[chunk_rows - 1] = 1
            elif not shape.is_last and self._model.lookahead_layers:
                # llama.cpp prunes unmarked rows in the model's last layer, here the lookahead layer, which
                # never runs: one output per batch keeps its output buffer at one row of logits.
                self._batch_outputs[:chunk_rows] = 0
                self._batch_outputs[chunk_rows - 1] = 1
            else:
                # Non-final shards mark every row: llama.cpp prunes unmarked rows in the last layer.
                self._batch_outputs[:chunk_rows] = 1
            batch.n_tokens = chunk_rows
            capture = self._capture
            if capture is not None:
                row_bytes = shape.n_embd * 4
                capture.dst = out.ctypes.data + chunk_start * row_bytes
                capture.dst_capacity = chunk_rows * row_bytes
                capture.captured_bytes = 0
                capture.overflow = 0
            status = llama_cpp.llama_decode(ctx, batch)
            if status != 0:
                self._roll_back(start_pos)
                if status == DECODE_ABORTED:
                    raise Cancelled("append cancelled", length=self._length)
                raise DecodeFailed(f"llama_decode returned {status}", length=self._length)
            if capture is not None:
                if capture.overflow or capture.captured_bytes != chunk_rows * shape.n_embd * 4:
                    self._roll_back(start_pos)
                    raise DecodeFailed(
                        f"captured {capture.captured_bytes} bytes for {chunk_rows} rows", length=self._length
                    )
            elif output_rows == "all":
                for row in range(chunk_rows):
                    source = llama_cpp.llama_get_logits_ith(ctx, row)
                    ctypes.memmove(out[chunk_start + row].ctypes.data, source, shape.n_vocab * 4)
            elif chunk_stop == n_rows:
                source = llama_cpp.llama_get_logits_ith(ctx, -1)
                ctypes.memmove(out.ctypes.data, source, shape.n_vocab * 4)
        self._length = start_pos + n_rows
        return out

    def _roll_back(self, length: int) -> None:
        # Micro-batches finished before a failure stay in the KV cache: remove them.
        llama_cpp.llama_memory_seq_rm(self._memory, SEQUENCE, length, -1)
        self._length = llama_cpp.llama_memory_seq_pos_max(self._memory, SEQUENCE) + 1
        assert self._length == length, (self._length, length)

    def truncate(self, n: int) -> int:
        """Keep positions [0, n). Returns the new length."""
        self._handle()
        if not 0 <= n <= self._length:
            raise PositionMismatch(
                f"cannot truncate to {n}: session length is {self._length}", length=self._length
            )
        if n < self._length:
            self._roll_back(n)
        return self._length

    def clear(self, *, data: bool) -> None:
        """Forget every position: length 0, as a new context. With `data` the KV buffers are zeroed too, as
        llama.cpp zeroes a new context's; without, the cells are only marked empty (what the next appends
        and restores see is the same either way: an empty cell is masked out, then overwritten)."""
        llama_cpp.llama_memory_clear(self._memory, data)
        self._length = 0

    def save_state(self) -> bytes:
        """The sequence's KV state, positions [0, length), as restore_state takes it."""
        return save_sequence(self._handle(), SEQUENCE)

    def save_state_to_memfd(self, head: int, tail: int) -> tuple[int, int]:
        """save_state written into a new memfd after `head` bytes and before `tail` (workers.runtime.sequence_io.
        save_sequence_to_memfd): (its descriptor, the state's bytes)."""
        return save_sequence_to_memfd(self._handle(), SEQUENCE, head, tail)

    def restore_state(self, blob: bytes | memoryview, length: int) -> int:
        """Load a saved state into this empty context and keep its positions [0, length). Raises
        RestoreFailed (the context must then be freed, never reused: its KV may be corrupt)."""
        ctx = self._handle()
        if self._length:
            raise BadInput("restore needs an empty context", length=self._length)
        if restore_sequence(ctx, SEQUENCE, blob) <= 0:
            raise RestoreFailed("llama.cpp refused the saved state", length=0)
        held = llama_cpp.llama_memory_seq_pos_max(self._memory, SEQUENCE) + 1
        if held < length or length > self.n_ctx:
            raise RestoreFailed(f"the saved state holds {held} positions, {length} expected", length=0)
        self._length = held
        if held > length:
            self._roll_back(length)
        return self._length

    def resume(self, length: int) -> int:
        """Keep positions [0, length) of the sequence this context still holds (a parked session's own spare:
        the cells its save was read from, never cleared since): what restore_state of that save would leave,
        with nothing loaded. Raises RestoreFailed, the context untouched, when llama.cpp's cells do not hold
        this context's whole length or `length` exceeds it."""
        self._handle()
        held = llama_cpp.llama_memory_seq_pos_max(self._memory, SEQUENCE) + 1
        first = llama_cpp.llama_memory_seq_pos_min(self._memory, SEQUENCE)
        if held != self._length or (held and first != 0) or not 0 <= length <= held:
            raise RestoreFailed(f"the kept cells hold positions [{first}, {held}), this context {self._length}, {length} asked", length=0)
        if held > length:
            self._roll_back(length)
        return self._length

    def close(self) -> None:
        """Idempotent; frees the batch and the context (the model stays)."""
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self._llama.close()
        self._model.forget(self)

    def __enter__(self) -> ShardContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

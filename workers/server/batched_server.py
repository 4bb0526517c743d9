"""A batched worker: one loaded shard, one context of `n_seqs` isolated sequences (workers.runtime.batched), each
serving one session; the supervisor's RunBatch decodes the appends of several sequences in one go.

Every command names its sequence and touches no other: open empties it and sets its session's n_ctx,
truncate and close act on it alone, save and restore move its state only. A RunBatch item that fails its
own checks fails alone; the others are decoded together, and a failed or cancelled decode leaves each of
its sequences as it was (BatchedShardContext rolls them back).
"""

from __future__ import annotations

import ctypes
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import numpy as np

from kvpool.wire.checks import check_position, input_rows
from workers.runtime.batch_plan import SeqAppend
from workers.runtime.batched import BatchedShardContext
from workers.runtime.errors import ShardRuntimeError, wire_checks
from workers.runtime.model import ShardModel
from workers.runtime.sampling import answer
from workers.server.commands import (
    OPEN_FAILED,
    RESTORE_FAILED,
    AnyCommand,
    Appended,
    BatchDone,
    BatchItem,
    ChannelState,
    CloseContext,
    Closed,
    Failed,
    OpenContext,
    Opened,
    Restored,
    RestoreState,
    RevokeChannel,
    RunBatch,
    Saved,
    SaveState,
    TruncateContext,
    Truncated,
)
from workers.server.segment import ABORT_FLAG_OFFSET

if TYPE_CHECKING:
    from workers.server.spec import WorkerSpec

BATCH_ROWS = 512  # llama.cpp's n_batch for the shared context, as a single context uses


class BatchedWorkerServer:
    def __init__(self, model: ShardModel, segment: shared_memory.SharedMemory, spec: WorkerSpec) -> None:
        self.model = model
        self.spec = spec
        self._buffer = segment.buf
        abort_flag_address = ctypes.addressof(ctypes.c_char.from_buffer(segment.buf, ABORT_FLAG_OFFSET))
        self.context = BatchedShardContext(
            model, spec.max_n_ctx, spec.seqs_per_worker, n_batch=BATCH_ROWS, abort_flag_address=abort_flag_address
        )
        self._limits = [0] * spec.seqs_per_worker  # each sequence's session n_ctx (0: no session)
        regions = spec.segment
        self._input = memoryview(segment.buf)[regions.input_offset : regions.output_offset]
        self._output = memoryview(segment.buf)[regions.output_offset : regions.total_bytes]
        # where a batch's one-row outputs (decode steps) are written, a row an item: kept from batch to batch (each
        # reply is copied out or sampled before the next batch), so a last shard's logits are not mapped and faulted
        # in afresh every step (glibc's mmap threshold is 128 KiB in a worker); as large as the largest batch of
        # one-row items yet, as much as that batch's outputs took when each was new
        self._step_rows = np.empty((0, model.shape.output_width), np.float32)

    def _seq(self, seq: int) -> Failed | None:
        if not 0 <= seq < self.spec.seqs_per_worker:
            return Failed(code="bad_command", message=f"no sequence {seq} in this worker")
        return None

    def handle(self, command: AnyCommand):
        seq = getattr(command, "seq", 0)
        if (bad := self._seq(seq)) is not None:
            return bad
        match command:
            case RevokeChannel():
                return ChannelState(length=0)
            case OpenContext(n_ctx=n_ctx):
                if not 1 <= n_ctx <= self.context.n_ctx_per_seq:
                    return Failed(code=OPEN_FAILED, message=f"n_ctx {n_ctx} is beyond this worker's {self.context.n_ctx_per_seq} per sequence")
                self.context.clear(seq)
                self._limits[seq] = n_ctx
                return Opened(n_ctx=n_ctx)
            case RunBatch(items=items):
                return BatchDone(results=self._run_batch(items))
            case TruncateContext(length=length):
                try:
                    return Truncated(length=self.context.truncate(seq, length))
                except ShardRuntimeError as error:
                    return Failed(code=error.code, message=str(error), length=error.length)
            case CloseContext(keep=True):
                return Failed(code="bad_command", message="a batched worker keeps no spare context: its sequences are emptied where they are")
            case CloseContext():
                self.context.clear(seq)
                self._limits[seq] = 0
                return Closed()
            case SaveState(keep=True):
                return Failed(code="bad_command", message="a batched worker keeps no spare context: its sequences are emptied where they are")
            case SaveState():
                if not self._limits[seq]:
                    return Failed(code="no_context", message=f"sequence {seq} serves no session")
                return Saved(length=self.context.length(seq), blob=self.context.save_state(seq))
            case RestoreState(n_ctx=n_ctx, blob=blob, length=length):
                return self._restore(seq, n_ctx, blob, length)
        return Failed(code="bad_command", message=f"a batched worker does not take {type(command).__name__}")

    def _restore(self, seq: int, n_ctx: int, blob: bytes, length: int):
        self.context.clear(seq)
        self._limits[seq] = 0
        try:
            held = self.context.restore_state(seq, blob)
            if held < length or length > n_ctx:
                raise ValueError(f"the saved state holds {held} positions, {length} expected")
            self.context.truncate(seq, length)
        except (ShardRuntimeError, ValueError) as error:
            self.context.clear(seq)  # per-sequence KV streams keep a refused restore away from the others
            return Failed(code=RESTORE_FAILED, message=str(error), length=0)
        self._limits[seq] = n_ctx
        return Restored(length=length)

    def _item_rows(self, item: BatchItem, seen: set[int]) -> np.ndarray | Failed:
        """The item's rows in the input region, or why it fails alone (the others still run)."""
        if (bad := self._seq(item.seq)) is not None:
            return bad
        length = self.context.length(item.seq)
        if item.seq in seen:
            return Failed(code="bad_command", message=f"sequence {item.seq} named twice in one batch", length=length)
        if not self._limits[item.seq]:
            return Failed(code="no_context", message=f"sequence {item.seq} serves no session", length=length)
        try:
            with wire_checks():
                check_position(item.start_pos, length, item.n_rows, self._limits[item.seq])
                return input_rows(self._input, self.model.shape, item.n_rows, item.input_offset, length=length)
        except ShardRuntimeError as error:
            return Failed(code=error.code, message=str(error), length=error.length)

    def _run_batch(self, items: list[BatchItem]) -> list[Appended | Failed]:
        results: list[Appended | Failed | None] = [None] * len(items)
        seen: set[int] = set()
        runnable: list[tuple[int, BatchItem, np.ndarray]] = []
        for index, item in enumerate(items):
            rows = self._item_rows(item, seen)
            if isinstance(rows, Failed):
                results[index] = rows
                continue
            seen.add(item.seq)
            runnable.append((index, item, rows))
        if runnable:
            try:
                outputs = self.context.append_many(
                    [SeqAppend(item.seq, item.start_pos, rows, item.output_rows) for _i, item, rows in runnable],
                    self._step_outputs([item.n_rows for _i, item, _rows in runnable]),
                )
            except ShardRuntimeError as error:
                lengths = getattr(error, "lengths", {})
                for index, item, _rows in runnable:
                    results[index] = Failed(code=error.code, message=str(error), length=lengths.get(item.seq, self.context.length(item.seq)))
            else:
                for (index, item, _rows), out in zip(runnable, outputs):
                    results[index] = self._reply(item, out)
        return results  # type: ignore[return-value]

    def _step_outputs(self, n_rows: list[int]) -> list[np.ndarray | None]:
        """Each item's output array for append_many: a kept row for a one-row append (a one-row append's output is
        one row on every shard), None (a new array) for any other."""
        wanted = sum(1 for count in n_rows if count == 1)
        if wanted > self._step_rows.shape[0]:
            self._step_rows = np.empty((wanted, self._step_rows.shape[1]), np.float32)
        outputs: list[np.ndarray | None] = []
        row = 0
        for count in n_rows:
            if count == 1:
                outputs.append(self._step_rows[row : row + 1])
                row += 1
            else:
                outputs.append(None)
        return outputs

    def _reply(self, item: BatchItem, out: np.ndarray) -> Appended:
        length = self.context.length(item.seq)
        reply = answer(out, item.sample, length)
        data = reply.rows
        inline = b""
        if data.nbytes > item.output_capacity or item.output_offset < 0 or item.output_offset + data.nbytes > len(self._output):
            inline = data.tobytes()
        elif data.nbytes:
            np.frombuffer(self._output, np.float32, data.size, item.output_offset)[:] = data.reshape(-1)
        return Appended(
            length=length, rows=data.shape[0], width=out.shape[1], inline=inline, output_offset=item.output_offset,
            **reply.reply_fields,
        )

    def release_free_heap(self) -> None:
        pass  # the one context lives as long as the worker

    def idle_in(self, now: float) -> float | None:
        return None  # no spare: a sequence of the one context is emptied where it is

    def idle(self, now: float) -> None:
        pass

    def close(self) -> None:
        self.context.close()
        self._input.release()  # the segment closes next: no view of it may outlive this
        self._output.release()

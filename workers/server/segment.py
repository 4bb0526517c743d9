"""Every offset of a worker's shared-memory segment in one place, read by both sides: the supervisor
(kvpool.daemon.pool.segment, controls) and the worker (workers.server.single, batched_server, direct).

[0, CONTROL_BYTES) control words, then the input region, then the output region. Each region holds what
one append moves across it: the input rows of the largest append a request can carry, and the output
rows of a non-final shard (one hidden state per input row) or a few rows of logits on the last shard. A
larger logits output (every row of a long prefill) travels in the worker's reply instead, so the segments
stay small (a 64 MiB /dev/shm, Docker's default, holds many) and nothing is written past what /dev/shm
can back (a write there would kill the worker with SIGBUS).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.wire.shape import ShardShape

# The control words: one writer each.
CONTROL_BYTES = 64
ABORT_FLAG_OFFSET = 0  # int32, set by the supervisor (or the worker's cancel thread): abort the append in flight
DIRECT_BUSY_OFFSET = 4  # int32, set by the worker while an append from its direct channel computes
DIRECT_LENGTH_OFFSET = 8  # int64, by the worker: the context's length after the last direct append
DIRECT_LAST_USED_OFFSET = 16  # float64, by the worker: time.monotonic() when that append ended
DIRECT_APPENDS_OFFSET = 24  # int64, by the worker: appends served from the direct channel
DIRECT_ROWS_OFFSET = 32  # int64, by the worker: their rows
DIRECT_BUSY_SINCE_OFFSET = 40  # float64, by the worker: time.monotonic() when the running direct append began

LOGIT_ROWS_IN_SEGMENT = 4
FLOAT_BYTES = 4
TOKEN_BYTES = 4


@dataclass(frozen=True, slots=True)
class SegmentRegions:
    """The sizes of the two regions; where each region starts follows from them."""

    input_bytes: int
    output_bytes: int

    @property
    def total_bytes(self) -> int:
        return CONTROL_BYTES + self.input_bytes + self.output_bytes

    @property
    def input_offset(self) -> int:
        return CONTROL_BYTES

    @property
    def output_offset(self) -> int:
        return CONTROL_BYTES + self.input_bytes

    @classmethod
    def for_shard(cls, shape: ShardShape, *, n_ctx: int, max_request_bytes: int) -> SegmentRegions:
        """Sized for the largest append: n_ctx rows, and no more hidden rows than one request frame holds."""
        if shape.is_first:
            max_rows = n_ctx
            input_bytes = max_rows * TOKEN_BYTES
        else:
            hidden_row_bytes = shape.n_embd * FLOAT_BYTES
            max_rows = max(1, min(n_ctx, max_request_bytes // hidden_row_bytes))
            input_bytes = max_rows * hidden_row_bytes
        output_rows = LOGIT_ROWS_IN_SEGMENT if shape.is_last else max_rows
        return cls(input_bytes=input_bytes, output_bytes=output_rows * shape.output_width * FLOAT_BYTES)

"""The shared-memory segment of one worker: what crosses it, its size, and room for all of them in /dev/shm.

Layout: [0, CONTROL_BYTES) control words (the abort flag), then the input region, then the output region.
Each region holds what one append moves across it: the input rows of the largest append a request can
carry, and the output rows of a non-final shard (one hidden state per input row) or a few rows of
logits on the last shard. A larger logits output (every row of a long prefill) travels in the worker's
reply instead, so the segments stay small (a 64 MiB /dev/shm, Docker's default, holds many) and nothing
is written past what /dev/shm can back (a write there would kill the worker with SIGBUS).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvpool.host import format_bytes
from kvpool.wire.shape import ShardShape
from workers.server.commands import CONTROL_BYTES

SHARED_MEMORY_DIR = "/dev/shm"
LOGIT_ROWS_IN_SEGMENT = 4
FLOAT_BYTES = 4
TOKEN_BYTES = 4


class SharedMemoryTooSmall(Exception):
    """/dev/shm has less free space than the workers' segments need."""


@dataclass(frozen=True, slots=True)
class SegmentLayout:
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
    def for_shard(cls, shape: ShardShape, *, n_ctx: int, max_request_bytes: int) -> SegmentLayout:
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


def free_shared_memory_bytes(directory: str = SHARED_MEMORY_DIR) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def check_room_for(segments: int, layout: SegmentLayout, *, directory: str = SHARED_MEMORY_DIR) -> None:
    """Refuse to start when `segments` segments of `layout` do not fit in the free space of `directory`."""
    needed = segments * layout.total_bytes
    free = free_shared_memory_bytes(directory)
    if needed > free:
        raise SharedMemoryTooSmall(
            f"{directory} has {format_bytes(free)} free but {segments} workers need {format_bytes(needed)} of shared "
            f"memory ({format_bytes(layout.total_bytes)} each); lower --max-sessions, --n-ctx or --max-request-bytes, "
            f"or give {directory} more room (docker run --shm-size)"
        )

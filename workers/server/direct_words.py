"""The control words a worker keeps about its direct channel in its segment, as ctypes views: written by
the worker (workers.server.direct), read by the supervisor (kvpool.daemon.pool.controls). The offsets
are workers.server.segment's."""

from __future__ import annotations

import ctypes

from workers.server.segment import (
    DIRECT_APPENDS_OFFSET,
    DIRECT_BUSY_OFFSET,
    DIRECT_BUSY_SINCE_OFFSET,
    DIRECT_LAST_USED_OFFSET,
    DIRECT_LENGTH_OFFSET,
    DIRECT_ROWS_OFFSET,
)


class DirectWords:
    """busy (an append from the channel computes), busy_since, length and last_used (after the last one),
    appends and rows (served so far). release() drops the views before the segment closes."""

    def __init__(self, buffer) -> None:
        self.busy = ctypes.c_int32.from_buffer(buffer, DIRECT_BUSY_OFFSET)
        self.busy_since = ctypes.c_double.from_buffer(buffer, DIRECT_BUSY_SINCE_OFFSET)
        self.length = ctypes.c_int64.from_buffer(buffer, DIRECT_LENGTH_OFFSET)
        self.last_used = ctypes.c_double.from_buffer(buffer, DIRECT_LAST_USED_OFFSET)
        self.appends = ctypes.c_int64.from_buffer(buffer, DIRECT_APPENDS_OFFSET)
        self.rows = ctypes.c_int64.from_buffer(buffer, DIRECT_ROWS_OFFSET)

    def release(self) -> None:
        del self.busy, self.busy_since, self.length, self.last_used, self.appends, self.rows

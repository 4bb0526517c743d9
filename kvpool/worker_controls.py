"""What a worker writes in the control words of its segment about its direct channel, read by the
supervisor between its own requests (kvpool.channels, housekeeping): busy, the length and time of the
last direct append, running counts, and since when it has been computing or stopped."""

from __future__ import annotations

import ctypes

import psutil

from workers.commands import (
    DIRECT_APPENDS_OFFSET,
    DIRECT_BUSY_OFFSET,
    DIRECT_BUSY_SINCE_OFFSET,
    DIRECT_LAST_USED_OFFSET,
    DIRECT_LENGTH_OFFSET,
    DIRECT_ROWS_OFFSET,
)


class DirectControls:
    def __init__(self, buffer) -> None:
        self._busy = ctypes.c_int32.from_buffer(buffer, DIRECT_BUSY_OFFSET)
        self._length = ctypes.c_int64.from_buffer(buffer, DIRECT_LENGTH_OFFSET)
        self._last_used = ctypes.c_double.from_buffer(buffer, DIRECT_LAST_USED_OFFSET)
        self._appends = ctypes.c_int64.from_buffer(buffer, DIRECT_APPENDS_OFFSET)
        self._rows = ctypes.c_int64.from_buffer(buffer, DIRECT_ROWS_OFFSET)
        self._busy_since = ctypes.c_double.from_buffer(buffer, DIRECT_BUSY_SINCE_OFFSET)
        self._stopped_since: float | None = None
        self._released = False

    def activity(self) -> tuple[bool, int, float]:
        """(an append from the direct channel computes now, the length after the last one, when it ended)."""
        if self._released:
            return False, 0, 0.0
        return bool(self._busy.value), self._length.value, self._last_used.value

    def counts(self) -> tuple[int, int]:
        """Appends and rows served from the direct channel over the worker's life."""
        return (0, 0) if self._released else (self._appends.value, self._rows.value)

    def stalled_for(self, pid: int, now: float) -> float:
        """How long the worker has not been answering its direct channel: computing one append, or
        stopped (a SIGSTOP, a debugger) as seen from /proc; 0 when it is not. The supervisor's request
        timeout applies to these as to its own calls."""
        if self._released:
            return 0.0
        try:
            stopped = psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            stopped = False
        if not stopped:
            self._stopped_since = None
        elif self._stopped_since is None:
            self._stopped_since = now
        busy = now - self._busy_since.value if self._busy.value else 0.0
        return max(busy, now - self._stopped_since if self._stopped_since is not None else 0.0)

    def release(self) -> None:
        """Drop the views (the segment is about to be closed)."""
        self._released = True
        del self._busy, self._length, self._last_used, self._appends, self._rows, self._busy_since

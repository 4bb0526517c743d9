"""What a worker writes in the control words of its segment about its direct channel, read by the
supervisor between its own requests (kvpool.daemon.pool.channels, housekeeping): busy, the length and time of the
last direct append, running counts, and since when it has been computing or stopped."""

from __future__ import annotations

import psutil

from workers.server.direct_words import DirectWords


class DirectControls:
    def __init__(self, buffer) -> None:
        self._words = DirectWords(buffer)
        self._stopped_since: float | None = None
        self._released = False

    def activity(self) -> tuple[bool, int, float]:
        """(an append from the direct channel computes now, the length after the last one, when it ended).

        The length and its time are one reading: the worker writes the length, then the time (workers.server.direct),
        so a time read before and after the length, unchanged, is the time of that length or of an earlier one. A
        length read before an append's end with the time read after it would pair the old length with the new time,
        and the supervisor, taking a length only with a later time (kvpool.daemon.pool.channels), would keep the old
        length for good."""
        if self._released:
            return False, 0, 0.0
        words = self._words
        busy = bool(words.busy.value)
        while True:
            ended = words.last_used.value
            length = words.length.value
            if words.last_used.value == ended:
                return busy, length, ended

    def counts(self) -> tuple[int, int]:
        """Appends and rows served from the direct channel over the worker's life."""
        return (0, 0) if self._released else (self._words.appends.value, self._words.rows.value)

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
        busy = now - self._words.busy_since.value if self._words.busy.value else 0.0
        return max(busy, now - self._stopped_since if self._stopped_since is not None else 0.0)

    def release(self) -> None:
        """Drop the views (the segment is about to be closed)."""
        self._released = True
        self._words.release()

"""The append in flight of one routed session, as the thread that cancels it sees it: whether there is
one, the daemon it has reached, and whether it was cancelled. One thread appends; any thread cancels."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from kvpool.router.recovery import Cancelled


class InFlightAppend:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._appending = False
        self.stage = -1  # the daemon the append has reached; -1 while none is in flight

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one append: a cancel before it does not count, one during it does."""
        with self._lock:
            self._cancelled.clear()
            self._appending = True
        try:
            yield
        finally:
            with self._lock:
                self._appending, self.stage = False, -1

    def reach(self, stage: int) -> None:
        """The append goes to daemon `stage` next, unless it was cancelled: then Cancelled(stage)."""
        self.stage = stage
        if self._cancelled.is_set():
            raise Cancelled(stage)

    def pause(self, seconds: float) -> None:
        """Wait `seconds`; a cancel ends the wait with Cancelled at the daemon reached."""
        if self._cancelled.wait(seconds):
            raise Cancelled(max(self.stage, 0))

    def cancel(self, epoch: Callable[[], int]) -> tuple[int, int] | None:
        """Mark the append in flight cancelled: the daemon it is at (-1: none yet) and `epoch()`, or None
        when no append is in flight. Both are read under the lock that ends an append, so they are the
        cancelled append's, never a later one's."""
        with self._lock:
            if not self._appending:
                return None
            self._cancelled.set()
            return self.stage, epoch()

"""The request bytes a daemon holds across all its connections, bounded (used by kvpool.daemon.transport.frames).

A frame's room is taken when its header declares its size, before its body is read, and given back once
its request has been dispatched; a frame that does not fit waits, unread, until enough is given back.
Invariant: `held` is the sum of the sizes of the HeldBytes not yet given back, and never exceeds `limit`.
"""

from __future__ import annotations

import asyncio
from collections import deque


class HeldBytes:
    """Room taken for one frame; give_back() is idempotent."""

    def __init__(self, allowance: ByteAllowance, size: int) -> None:
        self._allowance: ByteAllowance | None = allowance
        self.size = size

    def give_back(self) -> None:
        allowance, self._allowance = self._allowance, None
        if allowance is not None:
            allowance._give_back(self.size)


class ByteAllowance:
    """A frame that fits takes its room at once, frames waiting or not (a small Cancel is never held up
    behind a large frame of another connection); waiting frames are served in arrival order as room is
    given back, each as soon as it fits."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the byte allowance must be positive")
        self.limit = limit
        self.held = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def take(self, size: int) -> HeldBytes:
        """Wait until `size` bytes fit, then hold them (size must not exceed the limit)."""
        if not 0 <= size <= self.limit:
            raise ValueError(f"{size} bytes can never fit an allowance of {self.limit}")
        if self.held + size <= self.limit:
            self.held += size
            return HeldBytes(self, size)
        entry = (size, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif entry[1].done() and not entry[1].cancelled():
                self._give_back(size)  # granted, then cancelled before it could be used
            raise
        return HeldBytes(self, size)

    def _give_back(self, size: int) -> None:
        self.held -= size
        assert self.held >= 0, "gave back more than was held"
        for entry in list(self._waiting):
            waiting_size, granted = entry
            if granted.done():  # cancelled: its task removes it when it resumes
                continue
            if self.held + waiting_size <= self.limit:
                self._waiting.remove(entry)
                self.held += waiting_size
                granted.set_result(None)

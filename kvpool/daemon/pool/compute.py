"""Compute slots: at most --threads / --threads-per-worker workers compute at once (oversubscribing
ggml's thread pools on 2 cores was measured 25x slower); the peak in use is counted for stats."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ComputeSlots:
    def __init__(self, slots: int) -> None:
        self._semaphore = asyncio.Semaphore(slots)
        self._in_use = 0
        self.peak = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        async with self._semaphore:
            self._in_use += 1
            self.peak = max(self.peak, self._in_use)
            try:
                yield
            finally:
                self._in_use -= 1

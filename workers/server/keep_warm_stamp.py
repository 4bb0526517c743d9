"""The --keep-warm block's layout (kvpool.daemon.keep_warm): a small shared-memory block the supervisor creates,
its first 8 bytes the end of the last session request (a C double, time.monotonic(): one clock for every process of
the machine; -inf until the first), written by the supervisor and by every worker's direct channel; then one state
byte per spinner (starting, asleep, waiting for its CPU's lock, spinning), written by the spinner, read for
`kvpool status`."""

from __future__ import annotations

import ctypes
import math
import time

STAMP_BYTES = 8
MAX_SPINNERS = 256  # state bytes after the stamp: one per CPU the daemon may run on, at most this many
BLOCK_BYTES = STAMP_BYTES + MAX_SPINNERS
STARTING, ASLEEP, WAITING, SPINNING = 0, 1, 2, 3  # STARTING: the block's zero, before the spinner first writes


class Stamp:
    """A view of the block: the last request's end and each spinner's state."""

    def __init__(self, buffer) -> None:
        self._stamp = ctypes.c_double.from_buffer(buffer, 0)
        self._states = (ctypes.c_uint8 * MAX_SPINNERS).from_buffer(buffer, STAMP_BYTES)

    def touch(self, now: float | None = None) -> None:
        """A request ended `now` (time.monotonic(), read here when not given; every writer writes the same clock: the
        last one wins)."""
        self._stamp.value = time.monotonic() if now is None else now

    def forget(self) -> None:
        """No request yet (the block is made so: a zero would be a moment of the clock, at boot)."""
        self._stamp.value = -math.inf

    @property
    def last_request(self) -> float:
        """time.monotonic() of the last request's end; -inf before the first."""
        return self._stamp.value

    def within(self, window_s: float) -> bool:
        """Whether the last request ended at most `window_s` ago."""
        return time.monotonic() - self._stamp.value <= window_s

    def state(self, slot: int) -> int:
        return self._states[slot]

    def set_state(self, slot: int, state: int) -> None:
        self._states[slot] = state

    def release(self) -> None:
        del self._stamp, self._states

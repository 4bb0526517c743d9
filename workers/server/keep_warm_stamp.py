"""The --keep-warm block's layout (kvpool.daemon.keep_warm): a small shared-memory block the supervisor creates,
its first 8 bytes the end of the last session request (a C double, time.monotonic(): one clock for every process of
the machine), written by the supervisor and by every worker's direct channel; then one state byte per spinner
(asleep, waiting for its CPU's lock, spinning), written by the spinner, read for `kvpool status`."""

from __future__ import annotations

import ctypes
import time

STAMP_BYTES = 8
MAX_SPINNERS = 256  # state bytes after the stamp: one per CPU the daemon may run on, at most this many
BLOCK_BYTES = STAMP_BYTES + MAX_SPINNERS
ASLEEP, WAITING, SPINNING = 0, 1, 2


class Stamp:
    """A view of the block: the last request's end and each spinner's state."""

    def __init__(self, buffer) -> None:
        self._stamp = ctypes.c_double.from_buffer(buffer, 0)
        self._states = (ctypes.c_uint8 * MAX_SPINNERS).from_buffer(buffer, STAMP_BYTES)

    def touch(self) -> None:
        """A request ended now (every writer writes the same clock: the last one wins)."""
        self._stamp.value = time.monotonic()

    @property
    def last_request(self) -> float:
        return self._stamp.value

    def state(self, slot: int) -> int:
        return self._states[slot]

    def set_state(self, slot: int, state: int) -> None:
        self._states[slot] = state

    def release(self) -> None:
        del self._stamp, self._states

"""At most N workers of one daemon compute at once, across processes: N one-byte ranges of a file, held
with fcntl record locks, which the kernel releases when a holder dies (a killed worker never keeps one)."""

from __future__ import annotations

import fcntl
import os


class ComputeLocks:
    def __init__(self, path: str, count: int, preferred: int) -> None:
        self._fd = os.open(path, os.O_RDWR)
        self._preferred = preferred % count
        self._order = [(self._preferred + offset) % count for offset in range(count)]  # the preferred slot first
        self._held: int | None = None

    def __enter__(self) -> ComputeLocks:
        for slot in self._order:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
            except OSError:
                continue
            self._held = slot
            return self
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self._preferred)
        self._held = self._preferred
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._held is not None:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._held)
            self._held = None

    def close(self) -> None:
        os.close(self._fd)

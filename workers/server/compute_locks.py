"""At most N workers of one daemon compute at once, across processes: N one-byte ranges of a file, held
with fcntl record locks, which the kernel releases when a holder dies (a killed worker never keeps one).

A worker that finds every slot held waits for the first to free. A record lock can be waited for on one
range only, so waiting on a slot chosen in advance (as this did before stop 54) left a freed slot idle while its
waiters waited on the other one, for up to a whole step of the other holder's compute. Now the waiters queue on
one more range of the file (the line: one byte after the slots); the one at its head watches the bell, a FIFO
beside the file (bell_path) into which every holder writes a byte as it lets its slot go, and takes a free slot
when it rings. A holder that dies rings nothing: the head looks again every BELL_CHECK_S all the same (a slot
so freed waits up to that long). A newcomer takes a free slot before it queues, so the line is not strictly first
come, first served; a head that is itself slow to run keeps the others behind it waiting. A byte
rung while nobody waits stays in the FIFO (its 64 KiB take any number of them, a full one is not waited for)
and wakes the next head once, which looks and waits again. With one slot there is no choice to make: a waiter
waits on it, and the kernel hands it over as it frees."""

from __future__ import annotations

import errno
import fcntl
import os
import select

BELL_CHECK_S = 0.05  # how often the head of the line looks at the slots with no ring (a holder that died)
BELL_SUFFIX = ".bell"


def bell_path(path: str) -> str:
    """The FIFO the holders ring as they let a slot go (beside the lock file)."""
    return path + BELL_SUFFIX


class ComputeLocks:
    def __init__(self, path: str, count: int, preferred: int, *, bell_check_s: float = BELL_CHECK_S) -> None:
        self._fd = os.open(path, os.O_RDWR)
        try:  # one slot: no choice, no bell (nothing is waited for but that slot)
            self._bell = os.open(bell_path(path), os.O_RDWR | os.O_NONBLOCK) if count > 1 else None  # read-write: never blocks, never EOF
        except OSError:
            os.close(self._fd)
            raise
        self._line = count  # the range the waiters queue on
        self._order = [(preferred % count + offset) % count for offset in range(count)]  # the preferred slot first
        self._bell_check_s = bell_check_s
        self._held: int | None = None

    def _take_free(self) -> bool:
        for slot in self._order:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
            except OSError as error:
                if error.errno not in (errno.EACCES, errno.EAGAIN):  # held by another: anything else is no lock to wait for
                    raise
                continue
            self._held = slot
            return True
        return False

    def _drain_bell(self, bell: int) -> None:
        try:
            while os.read(bell, 65536):
                pass
        except BlockingIOError:
            pass

    def __enter__(self) -> ComputeLocks:
        if self._take_free():
            return self
        if self._bell is None:  # one slot: the kernel hands it to a waiter as it frees
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
            self._held = 0
            return self
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, self._line)  # the head of the line from here
        try:
            while True:
                self._drain_bell(self._bell)  # a ring from now on wakes the select below
                if self._take_free():
                    return self
                select.select([self._bell], [], [], self._bell_check_s)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._line)

    def __exit__(self, *exc_info: object) -> None:
        if self._held is not None:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._held)
            self._held = None
            if self._bell is not None:
                try:
                    os.write(self._bell, b"\0")
                except BlockingIOError:
                    pass  # full: rung often enough already

    def close(self) -> None:
        if self._bell is not None:
            os.close(self._bell)
        os.close(self._fd)

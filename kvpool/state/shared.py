"""A saved state held in shared memory: one memfd, mapped read-only, that nobody can change once sealed
(F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL).

Why: a park of 512 positions on the bundled middle shard copied its 3.76 MiB four times between llama.cpp's
save and its restore (the worker's memfd, the supervisor's bytes, the sealed bytes, the restore's memfd),
each into fresh memory (evidence/warm-tier/README.md, "Stop 37"). Now the worker writes llama.cpp's bytes
into a memfd with room left before them for the header and after them for the CRC (SaveState.head /
.tail); the supervisor writes those two in (kvpool.state.header.seal_shared), seals the memfd, and keeps it
as the stored state; a restore sends the same descriptor back to a worker, which hands llama.cpp the
mapping. Sealed, the bytes cannot change behind the store's back, so opening one again needs no second
pass over them (its CRC was computed over these very pages).

Its mapping is private (MAP_PRIVATE, read-only: the pages themselves, never copied unless written, which
nothing does): a shared one counts as writable to the kernel and F_SEAL_WRITE would refuse (EBUSY).

A SharedState owns its descriptor and mapping: `close()` (idempotent; also when it is garbage) frees them.
A process keeps at most `SharedState.limit` open at once (descriptors are finite: RLIMIT_NOFILE); past it a
receiver takes the bytes as a copy instead (`SharedState.available()`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
import threading
import weakref
from collections.abc import Iterable

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # set as it arrives: a sender that truncates it then cannot make a reader's mapping fault (SIGBUS)
MEMFD_NAME = "kvpool-state"


def _default_limit() -> int:
    """A quarter of the descriptors this process may open (the rest stay for sockets, files and workers)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) // 4)


def new_memfd() -> int:
    """An empty memfd that can be sealed later (MFD_ALLOW_SEALING), closed on exec."""
    return os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def memfd_of(parts: Iterable[bytes | memoryview], head: int = 0, tail: int = 0) -> int:
    """A memfd holding the bytes of `parts` one after another after `head` bytes, `tail` bytes after them (those zeros)."""
    views = [memoryview(part).cast("B") for part in parts]
    fd = new_memfd()
    try:
        os.ftruncate(fd, head + sum(len(view) for view in views) + tail)
        offset = head
        for view in views:
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], offset + written)
            offset += len(view)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _close_quietly(fd: int, mapping: mmap.mmap | None) -> None:
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:  # a view still exported: the mapping goes with the last one
            pass
    os.close(fd)


class SharedState:
    """`nbytes` bytes of a memfd: `head` bytes before llama.cpp's `payload_bytes`, `tail` after. Takes
    ownership of `fd`, whose size is sealed already (`adopt`). `view` is read-only; `sealed` once nothing
    can change the bytes."""

    limit = _default_limit()
    _open = 0
    _count_lock = threading.Lock()  # finalizers may run in any thread

    def __init__(self, fd: int, *, head: int, payload_bytes: int, tail: int) -> None:
        self.fd = fd
        self.head = head
        self.payload_bytes = payload_bytes
        self.tail = tail
        self.nbytes = head + payload_bytes + tail
        try:
            size = os.fstat(fd).st_size
            if size != self.nbytes:
                raise ValueError(f"a shared state of {self.nbytes} bytes arrived with {size}")
            self._mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ) if size else None
        except BaseException:
            os.close(fd)
            raise
        with SharedState._count_lock:
            SharedState._open += 1
        self._finalizer = weakref.finalize(self, SharedState._release, fd, self._mapping)

    @classmethod
    def adopt(cls, fd: int, *, head: int, payload_bytes: int, tail: int) -> SharedState | None:
        """A SharedState of a received memfd, its size sealed first; None, `fd` left open and untouched,
        when it cannot be (a memfd made without MFD_ALLOW_SEALING, or not a memfd): the caller reads it."""
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        except OSError:
            return None
        return cls(fd, head=head, payload_bytes=payload_bytes, tail=tail)

    @classmethod
    def written(cls, parts: Iterable[bytes | memoryview], *, head: int, tail: int) -> SharedState:
        """A new one holding the bytes of `parts` as its payload, with `head` and `tail` bytes of room around
        them (for kvpool.state.header.seal_shared), unsealed; the caller checks `available()` first."""
        fd = memfd_of(parts, head, tail)
        return cls(fd, head=head, payload_bytes=os.fstat(fd).st_size - head - tail, tail=tail)

    @staticmethod
    def _release(fd: int, mapping: mmap.mmap | None) -> None:
        with SharedState._count_lock:
            SharedState._open -= 1
        _close_quietly(fd, mapping)

    @classmethod
    def available(cls) -> bool:
        """Another one may be kept open in this process."""
        return cls._open < cls.limit

    @classmethod
    def open_count(cls) -> int:
        return cls._open

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def view(self) -> memoryview:
        """The whole memfd, read-only."""
        if self.closed:
            raise ValueError("the shared state is closed")
        return memoryview(self._mapping if self._mapping is not None else b"").toreadonly()

    @property
    def payload(self) -> memoryview:
        """llama.cpp's bytes, read-only."""
        return self.view[self.head : self.head + self.payload_bytes]

    def write_at(self, offset: int, data: bytes) -> None:
        """Fill `data` in at `offset` (the header, the CRC); only before `seal()`."""
        if os.pwrite(self.fd, data, offset) != len(data):
            raise OSError(f"a short write into a shared state at {offset}")

    def seal(self) -> None:
        """No byte, size or seal of the memfd can change from now (raises OSError if another process still
        holds it writable: EBUSY)."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)

    @property
    def sealed(self) -> bool:
        return not self.closed and fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & SEALS == SEALS

    def __len__(self) -> int:
        return self.nbytes

    def close(self) -> None:
        self._finalizer()


class SharedPayload:
    """The payload of a sealed SharedState, as a restore hands it on: the descriptor and where in it
    llama.cpp's bytes lie (workers.server.pipe sends the descriptor, not the bytes)."""

    def __init__(self, state: SharedState) -> None:
        self.state = state

    @property
    def offset(self) -> int:
        return self.state.head

    @property
    def view(self) -> memoryview:
        return self.state.payload

    def __len__(self) -> int:
        return self.state.payload_bytes

    def close(self) -> None:
        self.state.close()


def payload_view(blob: bytes | memoryview | SharedPayload) -> memoryview:
    """A read-only view of a state's payload, whichever form it has."""
    return blob.view if isinstance(blob, SharedPayload) else memoryview(blob).toreadonly()


def close_payload(blob: object) -> None:
    """Free a SharedPayload's memory now (other forms are freed as garbage)."""
    if isinstance(blob, SharedPayload):
        blob.close()

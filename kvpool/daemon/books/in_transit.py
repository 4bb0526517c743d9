"""The bytes of states in transit through the daemon's socket, bounded: exports kept between their chunks
(ExportCache) and imports gathered from theirs (ImportBuffers). Pure bookkeeping: kvpool.daemon.transfer
decides what is saved, checked and admitted.

Invariants: an export's chunks are all cut from the one state its offset 0 saved (its export_id names it);
an import's chunks arrive in order, each naming the same total, and the bytes held for imports in progress
never exceed the import cap.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field

EXPORTS_KEPT = 8  # exports whose chunks may still be asked for at once: a new one past this waits (over_budget)
EXPORT_KEEP_S = 10.0  # an export not asked for a chunk this long is dropped
IMPORT_KEEP_S = 30.0  # an import that received no chunk this long is dropped


class TransferRefused(ValueError):
    """A chunk that does not belong where it claims (the import it named is dropped): bad_request."""


class ExportsFull(Exception):
    """Every kept export is still being read: a new one must wait (over_budget, retry_after_s)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class KeptExport:
    session_id: str
    epoch: int
    export_id: int
    state: bytes
    length: int
    touched: float
    finished: bool = False  # its last byte was handed out: it gives way first

    def chunk(self, offset: int, chunk_bytes: int) -> bytes:
        if not 0 <= offset < len(self.state):
            raise TransferRefused(f"offset {offset} is outside the export's {len(self.state)} bytes")
        if offset + chunk_bytes >= len(self.state):
            self.finished = True
        return self.state[offset : offset + chunk_bytes]


class ExportCache:
    """Every export stands, named by its export_id, until its last chunk was handed out or it sat idle for
    `keep_s`: a second export of the same session (another caller's) never cuts a first one short. At most
    `kept` exports are held; a finished one gives way to a new one, an unfinished one never does."""

    def __init__(self, *, kept: int = EXPORTS_KEPT, keep_s: float = EXPORT_KEEP_S, clock=time.monotonic) -> None:
        self._kept = kept
        self._keep_s = keep_s
        self._clock = clock
        self._ids = itertools.count(1)
        self._exports: collections.OrderedDict[int, KeptExport] = collections.OrderedDict()

    def keep(self, session_id: str, epoch: int, state: bytes, length: int) -> KeptExport:
        """A new export of the session, beside any other in progress; ExportsFull when `kept` unfinished
        exports are held (nothing is dropped for it)."""
        self._make_room()
        export = KeptExport(session_id, epoch, next(self._ids), state, length, self._clock())
        self._exports[export.export_id] = export
        return export

    def _make_room(self) -> None:
        self._expire()
        if len(self._exports) < self._kept:
            return
        finished = next((export_id for export_id, export in self._exports.items() if export.finished), None)
        if finished is None:
            oldest = min(export.touched for export in self._exports.values())
            raise ExportsFull(
                f"{len(self._exports)} exports are being read (this daemon keeps {self._kept} at once): export again later",
                retry_after_s=max(0.1, oldest + self._keep_s - self._clock()),
            )
        del self._exports[finished]

    def find(self, session_id: str, epoch: int, export_id: int) -> KeptExport:
        """The kept export that `export_id` names; TransferRefused when it is gone or another session's."""
        self._expire()
        export = self._exports.get(export_id)
        if export is None or (export.session_id, export.epoch) != (session_id, epoch):
            raise TransferRefused(f"export {export_id} of {session_id!r} epoch {epoch} is not kept (ended or idle): export again from offset 0")
        export.touched = self._clock()
        self._exports.move_to_end(export_id)
        return export

    def drop(self, session_id: str) -> None:
        """Every export of a session that ended."""
        for export_id in [key for key, export in self._exports.items() if export.session_id == session_id]:
            del self._exports[export_id]

    def _expire(self) -> None:
        now = self._clock()
        for export_id in [key for key, export in self._exports.items() if now - export.touched > self._keep_s]:
            del self._exports[export_id]

    def __len__(self) -> int:
        return len(self._exports)

    @property
    def held_bytes(self) -> int:
        return sum(len(export.state) for export in self._exports.values())


@dataclass(slots=True)
class PartialImport:
    epoch: int
    total_bytes: int
    touched: float
    received: bytearray = field(default_factory=bytearray)

    @property
    def complete(self) -> bool:
        return len(self.received) == self.total_bytes


class ImportBuffers:
    def __init__(self, cap_bytes: int, *, keep_s: float = IMPORT_KEEP_S, clock=time.monotonic) -> None:
        self.cap_bytes = cap_bytes  # one import's total at most, and all imports in progress together
        self._keep_s = keep_s
        self._clock = clock
        self._imports: collections.OrderedDict[str, PartialImport] = collections.OrderedDict()

    def add(self, session_id: str, epoch: int, offset: int, total_bytes: int, chunk: bytes) -> PartialImport:
        """The import with `chunk` added. Offset 0 starts it afresh; any other chunk must continue the import
        in progress for (session_id, epoch) at its end, with the same total: else TransferRefused, and that
        import is dropped. Imports in progress that would exceed the cap with a new one are dropped, oldest first."""
        self._expire()
        if not 0 < total_bytes <= self.cap_bytes:
            self._imports.pop(session_id, None)
            raise TransferRefused(f"total_bytes {total_bytes} must be in [1, {self.cap_bytes}] (this daemon's import cap)")
        if offset == 0:
            self._imports.pop(session_id, None)
            self._make_room(total_bytes)
            self._imports[session_id] = PartialImport(epoch, total_bytes, self._clock())
        partial = self._imports.get(session_id)
        if partial is None or partial.epoch != epoch:
            self._imports.pop(session_id, None)
            raise TransferRefused(f"no import of {session_id!r} epoch {epoch} is in progress: send its chunks from offset 0")
        problem = self._misfit(partial, offset, total_bytes, len(chunk))
        if problem:
            del self._imports[session_id]
            raise TransferRefused(f"{problem}: the import is dropped, send it again from offset 0")
        partial.received += chunk
        partial.touched = self._clock()
        self._imports.move_to_end(session_id)
        return partial

    @staticmethod
    def _misfit(partial: PartialImport, offset: int, total_bytes: int, chunk_bytes: int) -> str:
        if total_bytes != partial.total_bytes:
            return f"total_bytes changed from {partial.total_bytes} to {total_bytes}"
        if offset != len(partial.received):
            return f"a chunk at offset {offset}, the import holds {len(partial.received)} bytes (chunks go in order)"
        if chunk_bytes == 0 or offset + chunk_bytes > total_bytes:
            return f"a chunk of {chunk_bytes} bytes at offset {offset} does not fit in total_bytes {total_bytes}"
        return ""

    def take(self, session_id: str) -> bytes:
        """A complete import's bytes; it is no longer held."""
        partial = self._imports.pop(session_id)
        assert partial.complete, "only a complete import is taken"
        return bytes(partial.received)

    def drop(self, session_id: str) -> None:
        self._imports.pop(session_id, None)

    def _make_room(self, total_bytes: int) -> None:
        while self._imports and self.reserved_bytes + total_bytes > self.cap_bytes:
            self._imports.popitem(last=False)

    def _expire(self) -> None:
        now = self._clock()
        for session_id in [key for key, partial in self._imports.items() if now - partial.touched > self._keep_s]:
            del self._imports[session_id]

    @property
    def reserved_bytes(self) -> int:
        """Bytes the imports in progress may reach (their totals): never above cap_bytes."""
        return sum(partial.total_bytes for partial in self._imports.values())

    def __len__(self) -> int:
        return len(self._imports)

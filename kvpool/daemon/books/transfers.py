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

EXPORTS_KEPT = 4  # exports whose later chunks may still be asked for: the oldest is dropped past this
EXPORT_KEEP_S = 10.0  # an export not asked for a chunk this long is dropped
IMPORT_KEEP_S = 30.0  # an import that received no chunk this long is dropped


class TransferRefused(ValueError):
    """A chunk that does not belong where it claims (the import it named is dropped): bad_request."""


@dataclass(slots=True)
class KeptExport:
    epoch: int
    export_id: int
    state: bytes
    length: int
    touched: float

    def chunk(self, offset: int, chunk_bytes: int) -> bytes:
        if not 0 <= offset < len(self.state):
            raise TransferRefused(f"offset {offset} is outside the export's {len(self.state)} bytes")
        return self.state[offset : offset + chunk_bytes]


class ExportCache:
    def __init__(self, *, kept: int = EXPORTS_KEPT, keep_s: float = EXPORT_KEEP_S, clock=time.monotonic) -> None:
        self._kept = kept
        self._keep_s = keep_s
        self._clock = clock
        self._ids = itertools.count(1)
        self._exports: collections.OrderedDict[str, KeptExport] = collections.OrderedDict()

    def keep(self, session_id: str, epoch: int, state: bytes, length: int) -> KeptExport:
        """A new export of the session (replacing the one before it), the oldest dropped past `kept`."""
        self._expire()
        self._exports.pop(session_id, None)
        export = KeptExport(epoch, next(self._ids), state, length, self._clock())
        self._exports[session_id] = export
        while len(self._exports) > self._kept:
            self._exports.popitem(last=False)
        return export

    def find(self, session_id: str, epoch: int, export_id: int) -> KeptExport:
        """The kept export that `export_id` names; TransferRefused when it is gone or another."""
        self._expire()
        export = self._exports.get(session_id)
        if export is None or (export.epoch, export.export_id) != (epoch, export_id):
            raise TransferRefused(f"export {export_id} of {session_id!r} epoch {epoch} is not kept (ended, replaced or idle): export again from offset 0")
        export.touched = self._clock()
        self._exports.move_to_end(session_id)
        return export

    def drop(self, session_id: str) -> None:
        self._exports.pop(session_id, None)

    def _expire(self) -> None:
        now = self._clock()
        for session_id in [key for key, export in self._exports.items() if now - export.touched > self._keep_s]:
            del self._exports[session_id]

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

"""The spill store: saved session states (blobs) of parked sessions, in memory and optionally on disk.

Each tier has a byte limit and keeps its blobs least recently stored first. A blob that does not fit in
memory pushes the oldest memory blobs to disk (when the disk tier is on and has room) or drops them; a
dropped blob's session is gone (the caller turns it into a cache miss). Every blob carries a CRC-32
checked when it is read back; disk files are written under a temporary name, then renamed.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import zlib
from collections.abc import Hashable

from kvpool.integrity import require

RAM = "ram"
DISK = "disk"
FILE_SUFFIX = ".kvstate"


class CorruptBlob(Exception):
    """A stored blob could not be read back intact (checksum, size, or the file is gone)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    nbytes: int
    crc32: int
    data: bytes | None  # None: on disk
    path: pathlib.Path | None = None


class SpillStore:
    def __init__(self, ram_limit_bytes: int, *, disk_dir: pathlib.Path | None = None, disk_limit_bytes: int = 0) -> None:
        self.ram_limit = max(0, ram_limit_bytes)
        self.disk_limit = max(0, disk_limit_bytes) if disk_dir is not None else 0
        self.disk_dir = disk_dir
        self._ram: collections.OrderedDict[Hashable, Stored] = collections.OrderedDict()
        self._disk: collections.OrderedDict[Hashable, Stored] = collections.OrderedDict()
        self._file_number = 0
        self._tier_bytes = {RAM: 0, DISK: 0}
        if disk_dir is not None:
            prepare_disk_dir(disk_dir)

    @property
    def enabled(self) -> bool:
        return self.ram_limit > 0

    @property
    def ram_bytes(self) -> int:
        return self._tier_bytes[RAM]

    @property
    def disk_bytes(self) -> int:
        return self._tier_bytes[DISK]

    def _add(self, tier: str, key: Hashable, item: Stored) -> None:
        (self._ram if tier == RAM else self._disk)[key] = item
        self._tier_bytes[tier] += item.nbytes

    def _pop_oldest(self, tier: str) -> tuple[Hashable, Stored]:
        key, item = (self._ram if tier == RAM else self._disk).popitem(last=False)
        self._tier_bytes[tier] -= item.nbytes
        return key, item

    def __contains__(self, key: Hashable) -> bool:
        return key in self._ram or key in self._disk

    def tier_of(self, key: Hashable) -> str:
        return RAM if key in self._ram else DISK

    def fits(self, nbytes: int) -> bool:
        return self.enabled and (nbytes <= self.ram_limit or nbytes <= self.disk_limit)

    def put(self, key: Hashable, blob: bytes) -> list[Hashable]:
        """Store `blob` (newest); returns the keys whose blobs were dropped to make room (`key` itself
        when it fits in no tier)."""
        require(key not in self, f"{key!r} is already stored")
        if not self.fits(len(blob)):
            return [key]
        stored = Stored(len(blob), zlib.crc32(blob), blob)
        dropped: list[Hashable] = []
        if len(blob) > self.ram_limit:
            dropped += self._to_disk(key, stored)
            return dropped
        self._add(RAM, key, stored)
        while self.ram_bytes > self.ram_limit:
            oldest, item = self._pop_oldest(RAM)
            dropped += self._to_disk(oldest, item)
        return dropped

    def _to_disk(self, key: Hashable, item: Stored) -> list[Hashable]:
        """Move one memory blob to disk, dropping the oldest disk blobs for room; [key] if it cannot go."""
        if self.disk_dir is None or item.nbytes > self.disk_limit:
            return [key]
        dropped: list[Hashable] = []
        while self.disk_bytes + item.nbytes > self.disk_limit:
            oldest, old = self._pop_oldest(DISK)
            _unlink(old.path)
            dropped.append(oldest)
        self._file_number += 1
        path = self.disk_dir / f"{self._file_number:08d}{FILE_SUFFIX}"
        partial = path.with_suffix(".partial")
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(item.data or b"")
        os.replace(partial, path)
        self._add(DISK, key, Stored(item.nbytes, item.crc32, None, path))
        return dropped

    def read(self, key: Hashable) -> bytes:
        """The blob, checked; raises CorruptBlob. The blob stays stored."""
        item = self._ram.get(key) or self._disk[key]
        data = item.data
        if data is None:
            try:
                data = item.path.read_bytes()
            except OSError as error:
                raise CorruptBlob(f"cannot read {item.path}: {error.strerror or error}") from None
        if len(data) != item.nbytes or zlib.crc32(data) != item.crc32:
            raise CorruptBlob(f"the stored state of {key!r} fails its checksum ({len(data)} of {item.nbytes} bytes)")
        return data

    def discard(self, key: Hashable) -> int:
        """Drop a blob if stored (idempotent); returns its size."""
        for tier, items in ((RAM, self._ram), (DISK, self._disk)):
            item = items.pop(key, None)
            if item is not None:
                self._tier_bytes[tier] -= item.nbytes
                _unlink(item.path)
                return item.nbytes
        return 0

    def path_of(self, key: Hashable) -> pathlib.Path | None:
        item = self._disk.get(key)
        return item.path if item is not None else None

    def close(self) -> None:
        for key in list(self._disk):
            self.discard(key)
        self._ram.clear()
        self._tier_bytes[RAM] = 0

    def check_integrity(self, parked_keys: set[Hashable]) -> None:
        require(set(self._ram) | set(self._disk) == parked_keys, "stored blobs != the parked sessions")
        require(not set(self._ram) & set(self._disk), "a blob in two tiers")
        require(self.ram_bytes == sum(item.nbytes for item in self._ram.values()), "memory tier bytes != its blobs")
        require(self.disk_bytes == sum(item.nbytes for item in self._disk.values()), "disk tier bytes != its blobs")
        require(self.ram_bytes <= self.ram_limit, f"memory tier holds {self.ram_bytes} > {self.ram_limit} bytes")
        require(self.disk_bytes <= self.disk_limit, f"disk tier holds {self.disk_bytes} > {self.disk_limit} bytes")


def prepare_disk_dir(directory: pathlib.Path) -> None:
    """Create (0700) or check the user's spill directory; files an earlier run left are deleted, never trusted."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise ValueError(f"--spill-dir {directory} is not owned by this user")
    os.chmod(directory, 0o700)
    for leftover in list(directory.glob(f"*{FILE_SUFFIX}")) + list(directory.glob("*.partial")):
        _unlink(leftover)


def _unlink(path: pathlib.Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass

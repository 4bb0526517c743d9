"""The spill store: saved session states (blobs) of parked sessions, in memory and optionally on disk.

Each tier has a byte limit and keeps its blobs least recently stored first. A blob that does not fit in
memory pushes the oldest memory blobs to disk (when the disk tier is on and has room) or drops them; a
dropped blob's session is gone (the caller turns it into a cache miss). A blob on disk carries a CRC-32
checked when it is read back (a file can change behind the store's back); a blob in memory is an immutable
bytes object or a sealed memfd (kvpool.state.shared: a park's state, kept where its worker wrote it and
freed as it leaves memory), checked by its length only: every blob is a sealed state (kvpool.state.header: it begins with
its MAGIC and ends with a CRC-32C, which opening it checks), so a second pass over it in memory, 1.4 ms for
the 3.8 MiB of a 512-token middle-shard session, would check nothing new. A disk file is the blob, written durably: under a temporary name, fsync'd, renamed,
and the directory fsync'd. A write that fails (the file system full, an I/O error) drops that blob alone,
leaves no file behind, and is counted in `disk_failures` (logged once per run of failures). Files survive
the process: a release, a new epoch or an expiry removes its session's, no stop of the daemon does (a drain
writes every parked state first; an interrupted drain and an immediate stop lose only what was in memory, as
a crash would). A store started on the directory lists them for adoption (`scan_disk_dir`).

A spill directory has one owner at a time (`SpillDirLock`): the store locks it before it removes or reads
anything there and holds it until it closes; a second daemon is refused at start, and one started while the
owner stops waits for it to let go.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import pathlib
import re
import stat
import time
import zlib
from collections.abc import Hashable, Sequence

from kvpool.daemon.books.integrity import require
from kvpool.state.header import MAGIC, StateHeader, StateIdentity, StateRejected, open_state
from kvpool.state.shared import SharedState

RAM = "ram"
DISK = "disk"
OLD_MAGIC = b"KVPSPIL1"  # the files of kvpool before states carried a header: never adopted, removed
FILE_PREFIX, FILE_SUFFIX, PARTIAL_SUFFIX = "kvpool-", ".kvstate", ".partial"
OWN_FILE = re.compile(re.escape(FILE_PREFIX) + r"\d+" + re.escape(FILE_SUFFIX))  # every name the store writes, `.partial` aside
LOCK_NAME = "kvpool.lock"  # the owner's lock file: none of OWN_FILE's names, so never scanned nor removed
STOPPING = "stopping"  # the lock file's second word once its owner stops
LOCK_TEXT_BYTES = 32
OWNER_WAIT_S = 300.0  # hang guard: how long a daemon waits for an owner that is stopping to let go
OWNER_POLL_S = 0.05
OWNER_PROGRESS_EVERY_S = 15.0

log = logging.getLogger("kvpool.serve")


class CorruptBlob(Exception):
    """A stored blob could not be read back intact (checksum, size, magic, or the file is gone), or it is
    another daemon's (`mismatch`: its identity differs, kvpool.daemon.books.sealing)."""

    def __init__(self, message: str, *, mismatch: bool = False) -> None:
        super().__init__(message)
        self.mismatch = mismatch


class SpillDirRefused(ValueError):
    """The --spill-dir cannot be trusted (a symlink, not the user's, writable by others) or used."""


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    nbytes: int
    crc32: int | None  # the disk file's CRC-32; None in memory (the module docstring)
    data: bytes | SharedState | None  # None: on disk; a SharedState is closed when it leaves memory
    path: pathlib.Path | None = None

    def release(self) -> None:
        """Free a shared state's memory (the store no longer holds it in memory)."""
        if isinstance(self.data, SharedState):
            self.data.close()


class SpillStore:
    def __init__(self, ram_limit_bytes: int, *, disk_dir: pathlib.Path | None = None, disk_limit_bytes: int = 0) -> None:
        self.ram_limit = max(0, ram_limit_bytes)
        self.disk_limit = max(0, disk_limit_bytes) if disk_dir is not None else 0
        self.disk_dir = disk_dir
        self._ram: collections.OrderedDict[Hashable, Stored] = collections.OrderedDict()
        self._disk: collections.OrderedDict[Hashable, Stored] = collections.OrderedDict()
        self._behind: dict[Hashable, Stored] = {}  # copies of hot sessions' states written behind (--persist-after): files only
        self._file_number = 0
        self._tier_bytes = {RAM: 0, DISK: 0}
        self.disk_failures = 0  # disk operations that raised OSError, since start
        self._disk_failing = False  # the last disk write failed: further failures are counted, not logged
        self._owner = prepare_disk_dir(disk_dir) if disk_dir is not None else None  # held until close()

    @property
    def enabled(self) -> bool:
        return self.ram_limit > 0

    @property
    def ram_bytes(self) -> int:
        return self._tier_bytes[RAM]

    @property
    def disk_bytes(self) -> int:
        return self._tier_bytes[DISK] + self.behind_bytes

    @property
    def behind_bytes(self) -> int:
        return sum(item.nbytes for item in self._behind.values())

    def write_behind(self, key: Hashable, blob: bytes) -> bool:
        """A hot session's state copied to a disk file that outlives the process (a crash leaves it for the
        next daemon to adopt), replacing its earlier copy; False when it does not fit the disk limit beside
        the parked states (a copy never pushes one out) or the write fails (no file left)."""
        if self.disk_dir is None:
            return False
        earlier = self._behind.pop(key, None)
        if self.disk_bytes + len(blob) > self.disk_limit:
            if earlier is not None:
                self._behind[key] = earlier
            return False
        path = self._next_path()
        try:
            _write_file(path, blob)
        except OSError as error:
            if earlier is not None:
                self._behind[key] = earlier
            self._disk_failed(f"writing {path}", error, "that session's copy is not kept (it stays hot)")
            return False
        self._disk_failing = False
        if earlier is not None:
            self._remove_file(earlier.path)
        self._behind[key] = Stored(len(blob), zlib.crc32(blob), None, path)
        return True

    def drop_behind(self, key: Hashable) -> None:
        """A session's copy written behind is no longer its state (released, truncated, a new epoch): removed."""
        item = self._behind.pop(key, None)
        if item is not None:
            self._remove_file(item.path)

    def _drop_behind_for(self, nbytes: int) -> None:
        """Copies written behind give way to parked states, oldest first."""
        while self._behind and self.disk_bytes + nbytes > self.disk_limit:
            self.drop_behind(next(iter(self._behind)))

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

    def put(self, key: Hashable, blob: bytes | SharedState) -> list[Hashable]:
        """Store `blob` (newest; a SharedState becomes the store's: closed once it leaves memory); returns the
        keys whose blobs were dropped to make room (`key` itself when it fits in no tier or its disk write
        failed). Never raises for a failing disk."""
        require(key not in self, f"{key!r} is already stored")
        if not self.fits(len(blob)):
            if isinstance(blob, SharedState):
                blob.close()
            return [key]
        stored = Stored(len(blob), None, blob)
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
        """Move one memory blob to disk, dropping the oldest disk blobs for room; `key` is among the
        returned (dropped) keys if it cannot go. The memory copy is freed either way."""
        try:
            return self._write_to_disk(key, item)
        finally:
            item.release()

    def _write_to_disk(self, key: Hashable, item: Stored) -> list[Hashable]:
        if self.disk_dir is None or item.nbytes > self.disk_limit:
            return [key]
        dropped: list[Hashable] = []
        self._drop_behind_for(item.nbytes)
        while self.disk_bytes + item.nbytes > self.disk_limit:
            oldest, old = self._pop_oldest(DISK)
            self._remove_file(old.path)
            dropped.append(oldest)
        path = self._next_path()
        data = item.data.view if isinstance(item.data, SharedState) else item.data or b""
        try:
            _write_file(path, data)
        except OSError as error:
            self._disk_failed(f"writing {path}", error, "that state is dropped (its session: cache_miss evicted)")
            return dropped + [key]
        self._disk_failing = False
        self._add(DISK, key, Stored(item.nbytes, zlib.crc32(data), None, path))
        return dropped

    def _next_path(self) -> pathlib.Path:
        assert self.disk_dir is not None
        while True:
            self._file_number += 1
            path = self.disk_dir / f"{FILE_PREFIX}{self._file_number:08d}{FILE_SUFFIX}"
            if not path.exists():  # a file kept from an earlier run, not adopted: never overwritten
                return path

    def _disk_failed(self, what: str, error: OSError, outcome: str) -> None:
        """Count every failure; log one line for the first of a burst (until a disk write succeeds)."""
        self.disk_failures += 1
        if not self._disk_failing:
            self._disk_failing = True
            log.warning(
                "spill disk tier: %s failed: %s; %s. Further failures are counted in spill_disk_failures, "
                "not logged, until a disk write succeeds", what, error.strerror or error, outcome,
            )

    def _remove_file(self, path: pathlib.Path | None) -> None:
        try:
            _unlink(path)
        except OSError as error:
            self._disk_failed(f"removing {path}", error, "the file stays (the store no longer counts it)")

    def read(self, key: Hashable) -> bytes | SharedState:
        """The blob, checked; raises CorruptBlob. The blob stays stored (a SharedState: still the store's)."""
        item = self._ram.get(key) or self._disk[key]
        data = item.data
        if data is None:
            try:
                data = _read_file(item.path)
            except OSError as error:
                raise CorruptBlob(f"cannot read {item.path}: {error.strerror or error}") from None
        if len(data) != item.nbytes or (item.crc32 is not None and zlib.crc32(data) != item.crc32):
            raise CorruptBlob(f"the stored state of {key!r} fails its checksum ({len(data)} of {item.nbytes} bytes)")
        return data

    def scan(self, identity: StateIdentity) -> tuple[list[FoundFile], collections.Counter]:
        """The files of an earlier run that open with `identity`, and the others counted by reason (removed)."""
        if self.disk_dir is None:
            return [], collections.Counter()
        return scan_disk_dir(self.disk_dir, identity, self.disk_limit)

    def adopt(self, key: Hashable, found: FoundFile) -> bool:
        """A file of an earlier run (scan_disk_dir) joins the disk tier as the newest blob; False, leaving it
        out, when it does not fit the disk limit."""
        require(key not in self, f"{key!r} is already stored")
        if self.disk_dir is None or self.disk_bytes + found.nbytes > self.disk_limit:
            return False
        self._add(DISK, key, Stored(found.nbytes, found.crc32, None, found.path))
        return True

    def discard(self, key: Hashable, *, close: bool = True) -> int:
        """Drop a blob if stored (idempotent); returns its size. `close=False`: a SharedState the caller took
        with read() becomes the caller's, left open."""
        for tier, items in ((RAM, self._ram), (DISK, self._disk)):
            item = items.pop(key, None)
            if item is not None:
                self._tier_bytes[tier] -= item.nbytes
                self._remove_file(item.path)
                if close:
                    item.release()
                return item.nbytes
        return 0

    def path_of(self, key: Hashable) -> pathlib.Path | None:
        item = self._disk.get(key)
        return item.path if item is not None else None

    def flush_to_disk(self) -> list[Hashable]:
        """Every memory blob to the disk tier, oldest first (a drain: the process is about to end); returns
        the keys dropped on the way (no room, or a failed write: no file left). The memory tier ends empty."""
        dropped: list[Hashable] = []
        while self._ram:
            key, item = self._pop_oldest(RAM)
            dropped += self._to_disk(key, item)
        return dropped

    def stopping(self) -> None:
        """The daemon stops: one started on the directory from now waits for the store to close."""
        if self._owner is not None:
            self._owner.stopping()

    def close(self, *, keep_files: bool = False) -> None:
        """Forget every blob (what was only in memory is gone) and let go of the directory. The disk files
        stay with `keep_files`, for the daemon that follows (every stop of a daemon: no stop removes a file
        already on disk); without it they are removed."""
        for key in list(self._disk):
            if keep_files:
                self._tier_bytes[DISK] -= self._disk.pop(key).nbytes
            else:
                self.discard(key)
        for key in list(self._behind):
            if keep_files:
                del self._behind[key]
            else:
                self.drop_behind(key)
        for item in self._ram.values():
            item.release()
        self._ram.clear()
        self._tier_bytes[RAM] = 0
        if self._owner is not None:
            self._owner.close()

    def check_integrity(self, parked_keys: set[Hashable], hot_keys: set[Hashable] | None = None) -> None:
        require(set(self._ram) | set(self._disk) == parked_keys, "stored blobs != the parked sessions")
        require(hot_keys is None or set(self._behind) <= hot_keys | parked_keys, "a copy written behind of no live session")
        require(not set(self._ram) & set(self._disk), "a blob in two tiers")
        require(self.ram_bytes == sum(item.nbytes for item in self._ram.values()), "memory tier bytes != its blobs")
        require(self._tier_bytes[DISK] == sum(item.nbytes for item in self._disk.values()), "disk tier bytes != its blobs")
        require(self.ram_bytes <= self.ram_limit, f"memory tier holds {self.ram_bytes} > {self.ram_limit} bytes")
        require(self.disk_bytes <= self.disk_limit, f"disk tier holds {self.disk_bytes} > {self.disk_limit} bytes")


# ---- disk files ------------------------------------------------------------------------------------


def _write_file(path: pathlib.Path, data: bytes) -> None:
    """`data` at `path`, complete or not at all, and durable once this returns: written under a temporary
    name, fsync'd, renamed, the directory fsync'd. On any failure the temporary file is removed."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(partial, path)
    except BaseException:
        _unlink(partial)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: pathlib.Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _read_file(path: pathlib.Path) -> bytes:
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a file swapped for a link is not followed
    with os.fdopen(descriptor, "rb") as stream:
        return stream.read()


def _unlink(path: pathlib.Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# ---- the spill directory ---------------------------------------------------------------------------


def check_disk_dir(directory: pathlib.Path, subdirs: Sequence[str] = ()) -> None:
    """Refuse (SpillDirRefused, one line) a spill directory that is not the user's alone: a symlink, owned
    by someone else, writable by group or others, or under a parent others can change; the same for each of
    `subdirs` found in it (folders other stores keep there: the prefix store's). Creates nothing (the
    configuration checks this before any worker starts); a directory not there yet passes."""
    directory = directory.absolute()
    _check_own(directory, parents=True)
    for name in subdirs:
        _check_own(directory / name, parents=False)  # inside a private directory: its parents are checked


def _check_own(directory: pathlib.Path, *, parents: bool) -> None:
    """`directory` (if there) is no symlink and the user's alone; with `parents`, so is the way to it."""
    if directory.is_symlink():
        raise SpillDirRefused(f"--spill-dir {directory} is a symlink: give the directory itself")
    if parents:
        _check_parents(directory)
    try:
        info = directory.stat()
    except FileNotFoundError:
        return
    except OSError as error:
        raise SpillDirRefused(f"--spill-dir {directory}: {error.strerror or error}") from None
    _check_private(directory, info)


def prepare_disk_dir(directory: pathlib.Path) -> SpillDirLock:
    """Check (check_disk_dir) and create (0700) the user's spill directory, lock it (lock_disk_dir), then
    delete the temporary files of writes an earlier run did not finish; its finished files are for
    scan_disk_dir. Returns the lock, the caller's to close. Raises SpillDirRefused."""
    directory = directory.absolute()
    check_disk_dir(directory)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_parents(directory)  # the ones just created too
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # ELOOP: swapped for a symlink
    except OSError as error:
        raise SpillDirRefused(f"--spill-dir {directory}: {error.strerror or error}") from None
    owner = None
    try:
        _check_private(directory, os.fstat(descriptor))  # the directory opened, not the name checked
        owner = lock_disk_dir(directory, descriptor)
        os.fchmod(descriptor, 0o700)
        _remove_partials(descriptor)
    except OSError as error:
        if owner is not None:
            owner.close()
        raise SpillDirRefused(f"--spill-dir {directory}: {error.strerror or error}") from None
    finally:
        os.close(descriptor)
    return owner


# ---- its one owner -------------------------------------------------------------------------------------


class SpillDirLock:
    """The one owner of a spill directory: an exclusive advisory lock (flock) on its LOCK_NAME file, whose
    text is the owner's pid (then STOPPING once it stops). The descriptor is close-on-exec, so no process the
    daemon starts holds the lock; the kernel lets go of it when the owner exits, however it ends (a SIGKILLed
    daemon's successor takes the directory at once). The file itself is never removed: a daemon locking a
    new file of that name while another holds the old one would be a second owner."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        _write_owner(descriptor, str(os.getpid()))

    def stopping(self) -> None:
        """Says so in the lock file: a daemon started on the directory from now waits instead of being
        refused. Never raises: a mark that fails costs that daemon's wait (it is refused), not the stop."""
        if self._descriptor >= 0:
            with contextlib.suppress(OSError):
                _write_owner(self._descriptor, f"{os.getpid()} {STOPPING}")

    def close(self) -> None:
        """Lets go (idempotent)."""
        if self._descriptor >= 0:
            os.close(self._descriptor)
            self._descriptor = -1


def lock_disk_dir(directory: pathlib.Path, directory_fd: int) -> SpillDirLock:
    """Take the directory (opened as `directory_fd`, already checked private) for this process: the lock
    file created if missing, then locked (_take). Raises SpillDirRefused, or OSError."""
    descriptor = _open_lock_file(directory, directory_fd, create=True)
    try:
        _take(descriptor, directory)
        return SpillDirLock(descriptor)
    except BaseException:
        os.close(descriptor)
        raise


def wait_for_disk_dir(directory: pathlib.Path) -> None:
    """The check of `kvpool serve` before any worker starts: SpillDirRefused at once when another daemon
    owns `directory`, or after waiting (_take) while its owner stops. Takes nothing for good (the store
    locks the directory when it opens: prepare_disk_dir) and creates nothing: a directory or lock file not
    there yet has no owner."""
    directory = directory.absolute()
    try:
        directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError as error:
        raise SpillDirRefused(f"--spill-dir {directory}: {error.strerror or error}") from None
    try:
        descriptor = _open_lock_file(directory, directory_fd, create=False)
    except FileNotFoundError:
        return
    except OSError as error:
        raise SpillDirRefused(f"--spill-dir {directory}: {error.strerror or error}") from None
    finally:
        os.close(directory_fd)
    try:
        _take(descriptor, directory)
    finally:
        os.close(descriptor)  # lets go


def _open_lock_file(directory: pathlib.Path, directory_fd: int, *, create: bool) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    descriptor = os.open(LOCK_NAME, flags, 0o600, dir_fd=directory_fd)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise SpillDirRefused(f"--spill-dir {directory}: its {LOCK_NAME} is not a regular file")
    return descriptor


def _take(descriptor: int, directory: pathlib.Path) -> None:
    """Lock the lock file, or refuse (SpillDirRefused, one line naming the owner's pid) when a daemon that is
    not stopping holds it. While its owner stops (or has not yet written its pid), waits up to OWNER_WAIT_S,
    logging a progress line at once and every OWNER_PROGRESS_EVERY_S."""
    deadline = time.monotonic() + OWNER_WAIT_S
    said_at = -math.inf
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        words = os.pread(descriptor, LOCK_TEXT_BYTES, 0).decode("ascii", "replace").split()  # [] until its first write
        pid = words[0] if words else "(not written yet)"
        stopping = words[1:] == [STOPPING]
        if (words and not stopping) or time.monotonic() > deadline:
            late = f"; it was still stopping after {OWNER_WAIT_S:.0f} s" if stopping else ""
            raise SpillDirRefused(f"--spill-dir {directory} is in use by kvpool serve pid {pid} (one daemon per spill directory){late}")
        if stopping and time.monotonic() - said_at >= OWNER_PROGRESS_EVERY_S:
            said_at = time.monotonic()
            log.info("--spill-dir %s is held by kvpool serve pid %s, which is stopping: waiting for it to let go", directory, pid)
        time.sleep(OWNER_POLL_S)


def _write_owner(descriptor: int, text: str) -> None:
    """One write of the whole text, padded to LOCK_TEXT_BYTES: a reader never sees the file empty once
    written, and rewriting it needs no room on the file system."""
    os.pwrite(descriptor, f"{text:<{LOCK_TEXT_BYTES - 1}}\n".encode("ascii"), 0)


def _check_private(directory: pathlib.Path, info: os.stat_result) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise SpillDirRefused(f"--spill-dir {directory} is not a directory")
    if info.st_uid != os.getuid():
        raise SpillDirRefused(f"--spill-dir {directory} is not owned by this user (uid {os.getuid()}) but by uid {info.st_uid}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SpillDirRefused(f"--spill-dir {directory} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}): use a private directory")


def _check_parents(directory: pathlib.Path) -> None:
    """Nobody but the user and root can rename or replace anything on the way to `directory`: every
    parent, as given and as resolved, belongs to one of them and is not writable by others unless sticky."""
    real_parent = directory.parent.resolve()
    for parent in {*directory.parents, real_parent, *real_parent.parents}:
        try:
            info = parent.lstat()
        except FileNotFoundError:
            continue  # not created yet
        if info.st_uid not in (os.getuid(), 0):
            raise SpillDirRefused(f"--spill-dir {directory}: its parent {parent} belongs to uid {info.st_uid}, neither this user nor root")
        writable_by_anyone = info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX
        if writable_by_anyone and not stat.S_ISLNK(info.st_mode):
            raise SpillDirRefused(f"--spill-dir {directory}: its parent {parent} is writable by others without the sticky bit")


def _remove_partials(directory_fd: int) -> None:
    """Delete the temporary files of writes an earlier run did not finish: never adopted."""
    with os.scandir(directory_fd) as entries:
        partials = [
            entry.name for entry in entries
            if entry.name.endswith(PARTIAL_SUFFIX) and OWN_FILE.fullmatch(entry.name.removesuffix(PARTIAL_SUFFIX))
            and entry.is_file(follow_symlinks=False)
        ]
    for name in partials:
        os.unlink(name, dir_fd=directory_fd)


# ---- adoption -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FoundFile:
    """A state file of an earlier run that opens here: its header says whose state it is."""

    path: pathlib.Path
    header: StateHeader
    nbytes: int
    crc32: int


REJECTED_REASONS = {
    "identity": "another shard, build or KV layout", "checksum": "corrupt", "truncated": "truncated",
    "header": "corrupt", "version": "another format version", "owner": "corrupt",
}


def scan_disk_dir(directory: pathlib.Path, identity: StateIdentity, max_file_bytes: int) -> tuple[list[FoundFile], collections.Counter]:
    """The store's files in `directory` that open with `identity` (checksum, framing, identity), and the
    count of the others by reason, each of those removed: a link or special file under one of the store's
    names (never followed), a file of the older format, truncated, corrupt, of another shard, build or
    layout, or larger than the disk limit. A file under the store's name without any kvpool magic is not
    the store's: it stays, counted as "left alone"."""
    found: list[FoundFile] = []
    rejected: collections.Counter = collections.Counter()
    with os.scandir(directory) as entries:
        candidates = sorted(entry.name for entry in entries if OWN_FILE.fullmatch(entry.name))
    for name in candidates:
        path = directory / name
        reason, item = _examine(path, identity, max_file_bytes)
        if item is not None:
            found.append(item)
            continue
        rejected[reason] += 1
        if reason != "left alone":
            try:
                _unlink(path)
            except OSError:
                pass  # counted all the same; it is never adopted
    return found, rejected


def _examine(path: pathlib.Path, identity: StateIdentity, max_file_bytes: int) -> tuple[str, FoundFile | None]:
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):
            return ("a link or not a regular file" if not stat.S_ISDIR(info.st_mode) else "left alone"), None
        if info.st_size > max_file_bytes:
            return "larger than --spill-disk-budget", None
        data = _read_file(path)
    except OSError as error:
        return f"unreadable ({error.strerror or error})", None
    if data.startswith(OLD_MAGIC):
        return "an older format", None
    if not data.startswith(MAGIC):
        return "left alone", None
    try:
        header, _payload = open_state(data, identity)
    except StateRejected as rejected:
        return REJECTED_REASONS.get(rejected.reason, rejected.reason), None
    return "", FoundFile(path, header, len(data), zlib.crc32(data))

"""The prefix store: states of prompts' leading blocks, content-addressed, from which a new session starts
instead of computing them (README, "Shared prefixes").

An entry holds llama.cpp's sequence state of exactly `blocks * block` positions, sealed with the daemon's
identity (kvpool.state.header) like every saved state, and the chained digests of its blocks (kvpool.wire.
prefix) under one scope. It serves every shorter block-aligned length of its chain too: the index maps each
(scope, digest) to every entry that holds it, so a prefix is stored once however many sessions offer it (an
offer the store already holds only touches it; an entry a longer one covers gives way to it, and the room it
leaves counts for the longer one). Prompts that share blocks and differ after them are entries apart, each
holding the shared blocks: one leaving leaves them found in the others. Entries are charged to the store's
byte limit and evicted least recently used first; an entry being read (`leased`) is never evicted. An offer
that stores nothing changes nothing (nothing is evicted before its file is written). With a directory
(--spill-dir/prefixes) every entry is also a file there, written durably; a daemon started on the directory
adopts the files of its own identity and block size and removes the others (and the temporary files of
writes it did not finish); no stop of the daemon removes a file (an eviction does).

A file: FILE_MAGIC | u32 meta length M | M bytes: PrefixMeta as msgpack | u32 CRC-32C of the meta | the sealed state.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import pathlib
import re
import struct
import time
from collections.abc import Iterator

import google_crc32c
import msgspec

from kvpool.daemon.books.integrity import require
from kvpool.daemon.books.spill import PARTIAL_SUFFIX, CorruptBlob, _read_file, _unlink, _write_file
from kvpool.state.header import FORMAT_VERSION, IDENTITY, StateHeader, StateIdentity, StateRejected, open_state, seal
from kvpool.state.sequence import StateFormatError, check_cells, cut_state, parse_state, write_state

FILE_MAGIC = b"KVPPREF1"
FILE_SUFFIX = ".kvprefix"
OWN_FILE = re.compile(r"prefix-\d+" + re.escape(FILE_SUFFIX))
SUBDIR = "prefixes"
_U32 = struct.Struct("<I")
MAX_META_BYTES = 1 << 20


class PrefixMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope: str
    block: int
    digests: tuple[bytes, ...]


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(PrefixMeta)


@dataclasses.dataclass(slots=True, eq=False)
class PrefixEntry:
    number: int
    scope: str
    digests: tuple[bytes, ...]
    sealed: bytes | None  # the sealed state in memory; None once the entry is gone
    nbytes: int
    last_used: float
    readers: int = 0
    path: pathlib.Path | None = None
    gone: bool = False  # evicted or covered while read: removed when its last reader lets go

    @property
    def blocks(self) -> int:
        return len(self.digests)


class PrefixStore:
    def __init__(self, limit_bytes: int, block: int, *, identity: StateIdentity, directory: pathlib.Path | None = None) -> None:
        self.limit = max(0, limit_bytes)
        self.block = block
        self.identity = identity
        self.directory = directory
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()  # least recently used first
        # (scope, digest) -> every entry holding it, by number (never empty: a digest no entry holds has no key)
        self._index: dict[tuple[str, bytes], dict[int, PrefixEntry]] = {}
        self._numbers = itertools.count(1)
        self.bytes = 0
        self.evictions = 0  # entries pushed out for room
        self.disk_failures = 0
        if directory is not None and self.enabled:
            directory.mkdir(mode=0o700, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def blocks(self) -> int:
        return sum(entry.blocks for entry in self._entries.values())

    # ---- reading ---------------------------------------------------------------------------------

    def holds(self, scope: str, digests: list[bytes]) -> int:
        """The leading blocks of `digests` some entry of `scope` holds (0: none). A chain is prefix-closed:
        block i's digest covers every block before it, so the longest digest found decides."""
        for blocks in range(len(digests), 0, -1):
            if self._holder(scope, digests[:blocks]) is not None:  # the leading chain itself, as an admission asks
                return blocks
        return 0

    def _holder(self, scope: str, digests: list[bytes] | tuple[bytes, ...]) -> PrefixEntry | None:
        """The most recently indexed entry of `scope` whose first blocks are `digests` (None: none)."""
        wanted = tuple(digests)
        holders = self._index.get((scope, wanted[-1]), {}) if wanted else {}
        return next((entry for entry in reversed(holders.values()) if entry.digests[: len(wanted)] == wanted), None)

    def _touch(self, entry: PrefixEntry) -> None:
        self._entries.move_to_end(entry.number)
        entry.last_used = time.monotonic()

    @contextlib.contextmanager
    def leased(self, scope: str, digests: list[bytes]) -> Iterator[PrefixEntry | None]:
        """The entry holding all of `digests` (None when none does), never evicted while the caller reads it."""
        entry = self._holder(scope, digests)
        if entry is None:
            yield None
            return
        entry.readers += 1
        self._touch(entry)
        try:
            yield entry
        finally:
            entry.readers -= 1
            if entry.gone and not entry.readers:
                self._remove(entry)

    def read(self, entry: PrefixEntry, blocks: int) -> bytes:
        """llama.cpp's bytes of the entry's first `blocks` blocks (the state cut to that length: a session
        admitted from them holds nothing beyond); raises CorruptBlob, and the entry is then gone."""
        require(0 < blocks <= entry.blocks, f"{blocks} blocks read from an entry of {entry.blocks}")
        try:
            if entry.sealed is None:
                raise StateRejected("truncated", "the entry is gone")
            header, payload = open_state(entry.sealed, self.identity)
            length = blocks * self.block
            if header.length != entry.blocks * self.block:
                raise StateRejected("owner", f"the stored prefix holds {header.length} positions, {entry.blocks * self.block} expected")
            check_cells(payload, header.length)
            return payload if length == header.length else write_state(cut_state(parse_state(payload), length))
        except (StateRejected, StateFormatError) as error:
            entry.gone = True
            self._unindex(entry)
            if not entry.readers:
                self._remove(entry)
            reason = f"{error} ({error.reason})" if isinstance(error, StateRejected) else str(error)
            raise CorruptBlob(f"the stored prefix is damaged: {reason}", mismatch=isinstance(error, StateRejected) and error.reason == IDENTITY) from None

    # ---- offers ----------------------------------------------------------------------------------

    def offer(self, scope: str, digests: list[bytes], payload: bytes, length: int, n_ctx: int) -> str:
        """A session's state (llama.cpp's bytes of `length` positions, >= len(digests) blocks) offered as the
        prefix its digests name, cut to those blocks. Returns what became of it: "stored", "held" (an entry
        already holds it: touched), "off", "empty", "too large" (beyond the limit alone), "no room" (every
        entry it would push out is being read), "unreadable" (the bytes do not parse) or "unwritable" (its file
        could not be written: counted in `disk_failures`). Anything but "stored" leaves the entries as they were."""
        if not self.enabled:
            return "off"
        if not digests:
            return "empty"
        held = self._holder(scope, digests)
        if held is not None:
            self._touch(held)
            return "held"
        prefix_length = len(digests) * self.block
        require(prefix_length <= length, f"a prefix of {prefix_length} positions offered from a state of {length}")
        try:  # a parked state may hold more positions than its session (a truncate cuts it when restored)
            cut = payload if check_cells(payload, prefix_length) == prefix_length else write_state(cut_state(parse_state(payload), prefix_length))
        except StateFormatError:
            return "unreadable"
        header = StateHeader(
            version=FORMAT_VERSION, identity=self.identity, session_id=f"prefix:{digests[-1].hex()}", epoch=0, length=prefix_length,
            n_ctx=max(n_ctx, prefix_length), saved_at=time.time(), last_used=time.time(), payload_bytes=len(cut),
        )
        sealed = seal(header, cut)
        if len(sealed) > self.limit:
            return "too large"
        covered = self._covered(scope, digests)
        victims = self._victims(len(sealed), covered)
        if victims is None:
            return "no room"
        entry = PrefixEntry(next(self._numbers), scope, tuple(digests), sealed, len(sealed), time.monotonic())
        if self.directory is not None and not self._write(entry):
            return "unwritable"
        for victim in victims:
            self._unindex(victim)
            self._remove(victim)
            self.evictions += 1
        self._add(entry, covered)
        return "stored"

    def _covered(self, scope: str, digests: list[bytes] | tuple[bytes, ...]) -> list[PrefixEntry]:
        """The entries of `scope` an entry of `digests` covers: those whose whole chain begins it."""
        wanted = tuple(digests)
        return [
            old for blocks, digest in enumerate(wanted, 1) for old in self._index.get((scope, digest), {}).values()
            if old.blocks == blocks and old.digests == wanted[:blocks]
        ]

    def _freed(self, covered: list[PrefixEntry]) -> int:
        """The bytes the covered entries give back as they give way (one being read is charged until released)."""
        return sum(old.nbytes for old in covered if not old.readers)

    def _victims(self, nbytes: int, covered: list[PrefixEntry]) -> list[PrefixEntry] | None:
        """The least recently used entries nobody reads whose eviction lets `nbytes` fit beside the rest,
        once the covered entries have given way; None when no choice of them does."""
        held = self.bytes - self._freed(covered)
        victims: list[PrefixEntry] = []
        for entry in self._entries.values():
            if held + nbytes <= self.limit:
                break
            if not entry.readers and all(entry is not old for old in covered):
                victims.append(entry)
                held -= entry.nbytes
        return victims if held + nbytes <= self.limit else None

    def _add(self, entry: PrefixEntry, covered: list[PrefixEntry]) -> None:
        """Index the entry under each of its digests; the shorter entries it covers give way to it."""
        for old in covered:
            self._unindex(old)
            if old.readers:
                old.gone = True
            else:
                self._remove(old)
        self._entries[entry.number] = entry
        self.bytes += entry.nbytes
        for digest in entry.digests:
            self._index.setdefault((entry.scope, digest), {})[entry.number] = entry

    def _unindex(self, entry: PrefixEntry) -> None:
        for digest in entry.digests:
            holders = self._index.get((entry.scope, digest))
            if holders is not None and holders.get(entry.number) is entry:
                del holders[entry.number]
                if not holders:
                    del self._index[(entry.scope, digest)]

    def _remove(self, entry: PrefixEntry) -> None:
        if self._entries.pop(entry.number, None) is not None:
            self.bytes -= entry.nbytes
        entry.sealed = None
        if entry.path is not None:
            try:
                _unlink(entry.path)
            except OSError:
                self.disk_failures += 1
            entry.path = None

    # ---- its files -------------------------------------------------------------------------------

    def _write(self, entry: PrefixEntry) -> bool:
        assert self.directory is not None and entry.sealed is not None
        meta = _meta_encoder.encode(PrefixMeta(entry.scope, self.block, entry.digests))
        path = self.directory / f"prefix-{entry.number:08d}{FILE_SUFFIX}"
        while os.path.lexists(path):  # a file (or link) of an earlier run not adopted: never overwritten
            entry.number = next(self._numbers)
            path = self.directory / f"prefix-{entry.number:08d}{FILE_SUFFIX}"
        data = b"".join((FILE_MAGIC, _U32.pack(len(meta)), meta, _U32.pack(google_crc32c.value(meta)), entry.sealed))
        try:
            _write_file(path, data)
        except OSError:
            self.disk_failures += 1
            return False
        entry.path = path
        return True

    def adopt(self) -> collections.Counter:
        """The entries an earlier run left in the directory whose identity and block size are this daemon's,
        newest kept while the limit has room; every other file of the store's is removed. Returns the count
        of the adopted ("adopted") and of the others by reason."""
        counts: collections.Counter = collections.Counter()
        if self.directory is None or not self.enabled:
            return counts
        require(not self._entries, "the prefix store adopts its directory's files before it stores anything")  # its own files are there too
        found = []
        with os.scandir(self.directory) as entries:
            listed = [entry.name for entry in entries if entry.is_file(follow_symlinks=False)]
        for name in listed:  # a write an earlier run did not finish (its number would refuse a write under it)
            if name.endswith(PARTIAL_SUFFIX) and OWN_FILE.fullmatch(name.removesuffix(PARTIAL_SUFFIX)):
                counts["unfinished write"] += 1
                with contextlib.suppress(OSError):
                    _unlink(self.directory / name)
        names = sorted(name for name in listed if OWN_FILE.fullmatch(name))
        for name in names:
            path = self.directory / name
            try:
                meta, sealed, header = self._examine(path)
            except (OSError, ValueError) as error:
                counts[str(error) if isinstance(error, ValueError) else "unreadable"] += 1
                with contextlib.suppress(OSError):
                    _unlink(path)
                continue
            found.append((header.saved_at, path, meta, sealed))
        for _saved_at, path, meta, sealed in sorted(found, key=lambda item: item[0], reverse=True):
            covered = self._covered(meta.scope, meta.digests)  # newer shorter entries: this one takes their place
            number = int(path.name.removeprefix("prefix-").removesuffix(FILE_SUFFIX))
            held = self._holder(meta.scope, meta.digests) is not None
            reason = "held twice" if held else "no room" if self.bytes - self._freed(covered) + len(sealed) > self.limit else None
            if reason is not None:
                counts[reason] += 1
                with contextlib.suppress(OSError):
                    _unlink(path)
                continue
            self._numbers = itertools.count(max(number + 1, next(self._numbers)))
            entry = PrefixEntry(number, meta.scope, meta.digests, sealed, len(sealed), time.monotonic(), path=path)
            self._add(entry, covered)
            self._entries.move_to_end(entry.number, last=False)  # older than what this run offers
            counts["adopted"] += 1 - len(covered)
            counts["held twice"] += len(covered)
        return +counts

    def _examine(self, path: pathlib.Path) -> tuple[PrefixMeta, bytes, StateHeader]:
        data = _read_file(path)
        if not data.startswith(FILE_MAGIC) or len(data) < len(FILE_MAGIC) + 2 * _U32.size:
            raise ValueError("not a prefix file")
        (size,) = _U32.unpack_from(data, len(FILE_MAGIC))
        start = len(FILE_MAGIC) + _U32.size
        if size > MAX_META_BYTES or start + size + _U32.size > len(data):
            raise ValueError("truncated")
        meta_bytes = data[start : start + size]
        (crc,) = _U32.unpack_from(data, start + size)
        if google_crc32c.value(meta_bytes) != crc:
            raise ValueError("corrupt")
        try:
            meta = _meta_decoder.decode(meta_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise ValueError("corrupt") from None
        sealed = data[start + size + _U32.size :]
        try:
            header, _payload = open_state(sealed, self.identity)
        except StateRejected as rejected:
            raise ValueError("another shard, build or KV layout" if rejected.reason == IDENTITY else "corrupt") from None
        if meta.block != self.block or not meta.digests or header.length != len(meta.digests) * self.block:
            raise ValueError("another --prefix-block")
        return meta, sealed, header

    def close(self) -> None:
        """Forget every entry held in memory; the files stay for the daemon that follows (no stop removes one)."""
        for entry in self._entries.values():
            entry.sealed = None
            entry.path = None
        self._entries.clear()
        self._index.clear()
        self.bytes = 0

    # ---- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        require(self.bytes == sum(entry.nbytes for entry in self._entries.values()), "prefix store bytes != its entries")
        require(self.bytes <= self.limit, f"the prefix store holds {self.bytes} > {self.limit} bytes")
        for (scope, digest), holders in self._index.items():
            require(bool(holders), "an index key no prefix entry holds")
            require(
                all(self._entries.get(number) is entry and not entry.gone and entry.scope == scope and digest in entry.digests for number, entry in holders.items()),
                "an indexed prefix entry is gone or does not hold its digest",
            )
        for number, entry in self._entries.items():
            require(entry.number == number and entry.sealed is not None and len(entry.sealed) == entry.nbytes, "a prefix entry's bytes are not its own")
            require((entry.path is not None) == (self.directory is not None), "a prefix entry without its file, or a file without a directory")
            if entry.gone:
                require(entry.readers > 0, "a gone prefix entry nobody reads is still held")
            else:
                require(
                    all(self._index.get((entry.scope, digest), {}).get(number) is entry for digest in entry.digests),
                    "a prefix entry is not indexed under each of its digests",
                )

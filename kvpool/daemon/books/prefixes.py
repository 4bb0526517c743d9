"""The prefix store: states of prompts' leading blocks, content-addressed, from which a new session starts
instead of computing them (README, "Shared prefixes").

An entry names the chained digests of its blocks (kvpool.wire.prefix) under one scope and holds llama.cpp's
sequence state of its positions, sealed with the daemon's identity (kvpool.state.header) like every saved
state. A prefix shared by several prompts is stored once: an offer whose first k blocks (0 < k < its length)
an entry holds is stored as a delta, a child of that holder (parent_blocks k) holding only the cells of
positions [k * block, blocks * block); a chain that extends an entry exactly becomes its child too. A whole
entry holds positions [0, blocks * block). Reading j blocks of an entry reads its parent when j <=
parent_blocks, and otherwise joins its parent's first parent_blocks blocks with its own cells cut to j blocks
(kvpool.state.sequence.join_states): byte for byte the state llama.cpp saves of those positions. A child whose
parent chain would be deeper than MAX_DEPTH is stored whole instead, so a read joins at most MAX_DEPTH + 1
states. The index maps each (scope, digest) to the entries whose own blocks hold it (an offer the store already
holds only touches it). Entries are charged their own sealed bytes to the store's byte limit and evicted least
recently used first among those with no child and no reader (evicting a child may free its parent); a lease
(`leased`) pins the entry and its ancestors. A read that finds an entry damaged takes it and its descendants.
An offer that stores nothing changes nothing (nothing is evicted before its file is written). With a directory
(--spill-dir/prefixes) every entry is also a file there, written durably; a daemon started on the directory
adopts the files of its own identity and block size, links each child to an adopted holder of its parent chain
(whole entries first), and removes the others (by reason: a child whose parent was not adopted is "no parent")
and the temporary files of writes it did not finish; no stop of the daemon removes a file (an eviction does).

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
from kvpool.state.header import FORMAT_VERSION, IDENTITY, StateHeader, StateIdentity, StateRejected, open_state, open_state_view, seal
from kvpool.state.sequence import (
    StateFormatError,
    as_sequence,
    check_cell_range,
    check_cells,
    join_states,
    parse_state,
    slice_state,
    state_parts,
    write_state,
)
from kvpool.state.shared import SharedState

FILE_MAGIC = b"KVPPREF1"
FILE_SUFFIX = ".kvprefix"
OWN_FILE = re.compile(r"prefix-\d+" + re.escape(FILE_SUFFIX))
SUBDIR = "prefixes"
_U32 = struct.Struct("<I")
MAX_META_BYTES = 1 << 20
MAX_DEPTH = 8  # ancestors a delta entry may have: a read joins at most MAX_DEPTH + 1 states


class PrefixMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope: str
    block: int
    digests: tuple[bytes, ...]
    parent_blocks: int = 0  # > 0: a delta entry, its sealed state holds positions [parent_blocks * block, len(digests) * block)


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(PrefixMeta)


@dataclasses.dataclass(slots=True, eq=False)
class PrefixEntry:
    number: int
    scope: str
    digests: tuple[bytes, ...]  # its whole chain, from block 0
    sealed: bytes | None  # its own cells' sealed state in memory; None once the entry is gone
    nbytes: int
    last_used: float
    parent: PrefixEntry | None = None  # the entry holding blocks [0, parent_blocks) (None: a whole entry)
    parent_blocks: int = 0
    children: dict[int, PrefixEntry] = dataclasses.field(default_factory=dict)  # by number, every child still held
    readers: int = 0  # leases of it or of a descendant
    path: pathlib.Path | None = None
    gone: bool = False  # damaged (or a damaged entry's descendant) while read: removed when its last reader lets go

    @property
    def blocks(self) -> int:
        return len(self.digests)

    @property
    def own_blocks(self) -> int:
        return self.blocks - self.parent_blocks

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    def lineage(self) -> Iterator[PrefixEntry]:
        """The entry, its parent, and so on up to its whole ancestor."""
        entry: PrefixEntry | None = self
        while entry is not None:
            yield entry
            entry = entry.parent


class PrefixStore:
    def __init__(self, limit_bytes: int, block: int, *, identity: StateIdentity, directory: pathlib.Path | None = None) -> None:
        self.limit = max(0, limit_bytes)
        self.block = block
        self.identity = identity
        self.directory = directory
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()  # least recently used first
        # (scope, digest) -> every entry whose own blocks hold it, by number (never empty: a digest no entry holds has no key)
        self._index: dict[tuple[str, bytes], dict[int, PrefixEntry]] = {}
        self._numbers = itertools.count(1)
        self.bytes = 0
        self.evictions = 0  # entries pushed out for room
        self.disk_failures = 0

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def __len__(self) -> int:
        """The prefixes held: entries (not gone) whose chain no other entry's extends. A chain stored as an
        entry and the child that extends it exactly count once, as the longer prefix, which serves every
        shorter length (what the daemon's stats and metrics call its entries); `entries` counts them apart."""
        return sum(1 for entry in self._entries.values() if not entry.gone and not self._extended(entry))

    def _extended(self, entry: PrefixEntry) -> bool:
        if any(child.parent_blocks == entry.blocks for child in entry.children.values()):
            return True
        holders = self._index.get((entry.scope, entry.digests[-1]), {})
        return any(other.blocks > entry.blocks and other.digests[: entry.blocks] == entry.digests for other in holders.values())

    @property
    def entries(self) -> int:
        """Every entry held, whole or delta."""
        return len(self._entries)

    @property
    def blocks(self) -> int:
        """The blocks the entries hold, each entry its own (a shared prefix's blocks count once)."""
        return sum(entry.own_blocks for entry in self._entries.values())

    # ---- reading ---------------------------------------------------------------------------------

    def holds(self, scope: str, digests: list[bytes]) -> int:
        """The leading blocks of `digests` some entry of `scope` holds (0: none). A chain is prefix-closed:
        block i's digest covers every block before it, so the longest digest found decides."""
        for blocks in range(len(digests), 0, -1):
            if self._holder(scope, digests[:blocks]) is not None:  # the leading chain itself, as an admission asks
                return blocks
        return 0

    def _holder(self, scope: str, digests: list[bytes] | tuple[bytes, ...]) -> PrefixEntry | None:
        """The most recently indexed entry of `scope` whose chain begins with `digests` and whose own blocks
        hold the last of them (None: none)."""
        wanted = tuple(digests)
        holders = self._index.get((scope, wanted[-1]), {}) if wanted else {}
        return next((entry for entry in reversed(holders.values()) if entry.digests[: len(wanted)] == wanted), None)

    def _touch(self, entry: PrefixEntry) -> None:
        self._entries.move_to_end(entry.number)
        entry.last_used = time.monotonic()

    @contextlib.contextmanager
    def leased(self, scope: str, digests: list[bytes]) -> Iterator[PrefixEntry | None]:
        """The entry holding all of `digests` (None when none does), never evicted, nor any of its ancestors,
        while the caller reads it."""
        entry = self._holder(scope, digests)
        if entry is None:
            yield None
            return
        lineage = list(entry.lineage())
        for pinned in lineage:
            pinned.readers += 1
        self._touch(entry)
        try:
            yield entry
        finally:
            for pinned in lineage:
                pinned.readers -= 1
            for pinned in lineage:  # children first: a gone parent goes once its gone children have
                if pinned.gone and not pinned.readers and not pinned.children:
                    self._remove(pinned)

    def read(self, entry: PrefixEntry, blocks: int, *, room: tuple[int, int] | None = None) -> bytes | SharedState:
        """llama.cpp's bytes of the entry's first `blocks` blocks (a session admitted from them holds nothing
        beyond): its ancestors' blocks joined with its own, cut to that length. With `room` (head, tail), where
        this process may keep one more SharedState, they are written once into a memfd with that room around
        them (a SharedState, unsealed: kvpool.state.header.seal_shared seals it in place and a restore hands its
        descriptor to the worker, no copy), else bytes. Raises CorruptBlob, and the damaged entry and its
        descendants are then gone."""
        require(0 < blocks <= entry.blocks, f"{blocks} blocks read from an entry of {entry.blocks}")
        pieces: list[tuple[PrefixEntry, int]] = []  # (an entry, the blocks read of it), from the whole ancestor down
        holder: PrefixEntry | None = entry
        stop = blocks
        while holder is not None and stop > 0:
            if stop > holder.parent_blocks:
                pieces.append((holder, stop))
                stop = holder.parent_blocks
            holder = holder.parent
        pieces.reverse()
        payloads = []
        for piece, _stop in pieces:
            try:
                payloads.append(self._payload(piece))
            except (StateRejected, StateFormatError) as error:
                raise self._damaged(piece, error) from None
        (last, last_stop), whole = pieces[-1], len(pieces) == 1 and pieces[0][0].parent_blocks == 0
        try:
            if whole and last_stop == last.blocks:
                out: list[bytes | memoryview] = [payloads[0]]
            else:
                parts = [slice_state(parse_state(payload), piece.parent_blocks * self.block, piece_stop * self.block) for (piece, piece_stop), payload in zip(pieces, payloads)]
                if len(parts) > 1:
                    # each piece was saved by its own session's sequence (batched mode: its own stream too): the whole
                    # ancestor's sequence takes them all, as llama.cpp would have saved that sequence holding them
                    root = parts[0]
                    stream = next((index for index, one in enumerate(root.streams) if one.n_cells), 0)
                    parts = [join_states([root] + [as_sequence(part, root.seq_id, stream) for part in parts[1:]])]
                out = state_parts(parts[0])
        except StateFormatError as error:
            raise self._damaged(entry, error) from None
        if room is not None and SharedState.available():
            return SharedState.written(out, head=room[0], tail=room[1])
        return b"".join(out)

    def _payload(self, entry: PrefixEntry) -> memoryview:
        """The entry's own state (a read-only view of its sealed bytes: parsed and cut without a copy), once its
        seal, its length and its cells (exactly its own positions) hold."""
        if entry.sealed is None:
            raise StateRejected("truncated", "the entry is gone")
        header, payload = open_state_view(entry.sealed, self.identity)
        if header.length != entry.blocks * self.block:
            raise StateRejected("owner", f"the stored prefix holds {header.length} positions, {entry.blocks * self.block} expected")
        check_cell_range(payload, entry.parent_blocks * self.block, entry.blocks * self.block)
        return payload

    def _damaged(self, entry: PrefixEntry, error: StateRejected | StateFormatError) -> CorruptBlob:
        """The entry and its descendants are gone (removed now, or once their readers let go)."""
        self._discard(entry)
        reason = f"{error} ({error.reason})" if isinstance(error, StateRejected) else str(error)
        return CorruptBlob(f"the stored prefix is damaged: {reason}", mismatch=isinstance(error, StateRejected) and error.reason == IDENTITY)

    def _discard(self, entry: PrefixEntry) -> None:
        for child in list(entry.children.values()):
            self._discard(child)
        entry.gone = True
        self._unindex(entry)
        if not entry.readers and not entry.children:
            self._remove(entry)

    # ---- offers ----------------------------------------------------------------------------------

    def offer(self, scope: str, digests: list[bytes], payload: bytes, length: int, n_ctx: int) -> str:
        """A session's state (llama.cpp's bytes of `length` positions, >= len(digests) blocks) offered as the
        prefix its digests name, cut to those blocks; when an entry holds its first blocks, only the cells
        after them are stored, as that entry's child. Returns what became of it: "stored", "held" (an entry
        already holds it: touched), "off", "empty", "too large" (beyond the limit alone), "no room" (every
        entry it would push out is being read or has a child), "unreadable" (the bytes do not parse) or
        "unwritable" (its file could not be written: counted in `disk_failures`). Anything but "stored"
        leaves the entries as they were."""
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
        shared = self.holds(scope, digests)
        parent = self._holder(scope, digests[:shared]) if shared else None
        if parent is not None and parent.depth >= MAX_DEPTH:
            parent = None  # stored whole: a deeper chain would make every read of it join more states
        parent_blocks = shared if parent is not None else 0
        try:  # a parked state may hold more positions than its session (a truncate cuts it when restored)
            if not parent_blocks and check_cells(payload, prefix_length) == prefix_length:
                own = payload
            else:
                check_cells(payload, prefix_length)
                own = write_state(slice_state(parse_state(payload), parent_blocks * self.block, prefix_length))
        except StateFormatError:
            return "unreadable"
        header = StateHeader(
            version=FORMAT_VERSION, identity=self.identity, session_id=f"prefix:{digests[-1].hex()}", epoch=0, length=prefix_length,
            n_ctx=max(n_ctx, prefix_length), saved_at=time.time(), last_used=time.time(), payload_bytes=len(own),
        )
        sealed = seal(header, own)
        if len(sealed) > self.limit:
            return "too large"
        victims = self._victims(len(sealed), parent)
        if victims is None:
            return "no room"
        entry = PrefixEntry(next(self._numbers), scope, tuple(digests), sealed, len(sealed), time.monotonic(), parent=parent, parent_blocks=parent_blocks)
        if self.directory is not None and not self._write(entry):
            return "unwritable"
        for victim in victims:  # children before their parents
            self._unindex(victim)
            self._remove(victim)
            self.evictions += 1
        self._add(entry)
        return "stored"

    def _victims(self, nbytes: int, parent: PrefixEntry | None) -> list[PrefixEntry] | None:
        """The least recently used entries nobody reads, without a child (once the children chosen before
        them go) and not the new entry's parent or its ancestors, whose eviction lets `nbytes` fit beside the
        rest; None when no choice of them does."""
        kept = {pinned.number for pinned in parent.lineage()} if parent is not None else set()
        chosen: dict[int, PrefixEntry] = {}
        children_left = {number: len(entry.children) for number, entry in self._entries.items()}
        held = self.bytes
        while held + nbytes > self.limit:
            victim = next((
                entry for number, entry in self._entries.items()
                if number not in chosen and number not in kept and not entry.readers and not children_left[number]
            ), None)
            if victim is None:
                return None
            chosen[victim.number] = victim
            held -= victim.nbytes
            if victim.parent is not None:
                children_left[victim.parent.number] -= 1
        return list(chosen.values())

    def _add(self, entry: PrefixEntry) -> None:
        """Hold the entry, indexed under each digest of its own blocks, its parent's child."""
        self._entries[entry.number] = entry
        self.bytes += entry.nbytes
        for digest in entry.digests[entry.parent_blocks :]:
            self._index.setdefault((entry.scope, digest), {})[entry.number] = entry
        if entry.parent is not None:
            entry.parent.children[entry.number] = entry

    def _unindex(self, entry: PrefixEntry) -> None:
        for digest in entry.digests[entry.parent_blocks :]:
            holders = self._index.get((entry.scope, digest))
            if holders is not None and holders.get(entry.number) is entry:
                del holders[entry.number]
                if not holders:
                    del self._index[(entry.scope, digest)]

    def _remove(self, entry: PrefixEntry) -> None:
        require(not entry.children, "a prefix entry removed before its children")
        if self._entries.pop(entry.number, None) is not None:
            self.bytes -= entry.nbytes
        if entry.parent is not None and entry.parent.children.get(entry.number) is entry:
            del entry.parent.children[entry.number]
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
        meta = _meta_encoder.encode(PrefixMeta(entry.scope, self.block, entry.digests, entry.parent_blocks))
        path = self.directory / f"prefix-{entry.number:08d}{FILE_SUFFIX}"
        while os.path.lexists(path):  # a file (or link) of an earlier run not adopted: never overwritten
            entry.number = next(self._numbers)
            path = self.directory / f"prefix-{entry.number:08d}{FILE_SUFFIX}"
        data = b"".join((FILE_MAGIC, _U32.pack(len(meta)), meta, _U32.pack(google_crc32c.value(meta)), entry.sealed))
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)  # at the first entry: a spill dir without prefixes holds no folder for them
            _write_file(path, data)
        except OSError:
            self.disk_failures += 1
            return False
        entry.path = path
        return True

    def adopt(self) -> collections.Counter:
        """The entries an earlier run left in the directory whose identity and block size are this daemon's,
        whole entries first and then children (each linked to an adopted holder of its parent chain), newest
        kept while the limit has room; every other file of the store's is removed. Returns the count of the
        adopted ("adopted") and of the others by reason."""
        counts: collections.Counter = collections.Counter()
        if self.directory is None or not self.enabled or not self.directory.is_dir():
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
        # a parent's parent_blocks is below its child's: by parent_blocks, every parent is adopted before its children
        found.sort(key=lambda item: item[0], reverse=True)
        found.sort(key=lambda item: item[2].parent_blocks)
        for _saved_at, path, meta, sealed in found:
            number = int(path.name.removeprefix("prefix-").removesuffix(FILE_SUFFIX))
            parent = self._holder(meta.scope, meta.digests[: meta.parent_blocks]) if meta.parent_blocks else None
            if self._holder(meta.scope, meta.digests) is not None:
                reason: str | None = "held twice"
            elif meta.parent_blocks and parent is None:
                reason = "no parent"
            elif parent is not None and parent.depth >= MAX_DEPTH:
                reason = "too deep"
            else:
                reason = "no room" if self.bytes + len(sealed) > self.limit else None
            if reason is not None:
                counts[reason] += 1
                with contextlib.suppress(OSError):
                    _unlink(path)
                continue
            self._numbers = itertools.count(max(number + 1, next(self._numbers)))
            entry = PrefixEntry(number, meta.scope, meta.digests, sealed, len(sealed), time.monotonic(), parent=parent, parent_blocks=meta.parent_blocks, path=path)
            self._add(entry)
            self._entries.move_to_end(entry.number, last=False)  # older than what this run offers
            counts["adopted"] += 1
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
            header, payload = open_state(sealed, self.identity)
        except StateRejected as rejected:
            raise ValueError("another shard, build or KV layout" if rejected.reason == IDENTITY else "corrupt") from None
        if meta.block != self.block or not meta.digests or header.length != len(meta.digests) * self.block:
            raise ValueError("another --prefix-block")
        if not 0 <= meta.parent_blocks < len(meta.digests):
            raise ValueError("corrupt")
        try:  # exactly its own positions: [0, blocks) whole, [parent_blocks, blocks) a delta (in blocks of `block`)
            check_cell_range(payload, meta.parent_blocks * self.block, header.length)
        except StateFormatError:
            raise ValueError("cells out of place") from None
        return meta, sealed, header

    def close(self) -> None:
        """Forget every entry held in memory; the files stay for the daemon that follows (no stop removes one)."""
        for entry in self._entries.values():
            entry.sealed = None
            entry.path = None
            entry.children.clear()
        self._entries.clear()
        self._index.clear()
        self.bytes = 0

    # ---- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        require(self.bytes == sum(entry.nbytes for entry in self._entries.values()), "prefix store bytes != its entries' own")
        require(self.bytes <= self.limit, f"the prefix store holds {self.bytes} > {self.limit} bytes")
        for (scope, digest), holders in self._index.items():
            require(bool(holders), "an index key no prefix entry holds")
            require(
                all(
                    self._entries.get(number) is entry and not entry.gone and entry.scope == scope and digest in entry.digests[entry.parent_blocks :]
                    for number, entry in holders.items()
                ),
                "an indexed prefix entry is gone or does not hold its digest among its own blocks",
            )
        for number, entry in self._entries.items():
            require(entry.number == number and entry.sealed is not None and len(entry.sealed) == entry.nbytes, "a prefix entry's bytes are not its own")
            require((entry.path is not None) == (self.directory is not None), "a prefix entry without its file, or a file without a directory")
            parent = entry.parent
            if parent is None:
                require(entry.parent_blocks == 0, "a whole prefix entry names parent blocks")
            else:
                require(self._entries.get(parent.number) is parent and parent.children.get(number) is entry, "a prefix entry's parent is not held or does not know it")
                require(
                    parent.scope == entry.scope and parent.parent_blocks < entry.parent_blocks <= parent.blocks
                    and parent.digests[: entry.parent_blocks] == entry.digests[: entry.parent_blocks],
                    "a prefix entry's parent does not hold its first blocks",
                )
                require(entry.depth <= MAX_DEPTH, f"a prefix entry {entry.depth} parents deep")
                require(entry.gone or not parent.gone, "a damaged prefix entry's child is still held")
            require(entry.parent_blocks < entry.blocks, "a prefix entry holds no block of its own")
            require(
                all(self._entries.get(child.number) is child and child.parent is entry for child in entry.children.values()),
                "a prefix entry's children are not held or name another parent",
            )
            require(entry.readers >= sum(child.readers for child in entry.children.values()), "a lease does not pin a prefix entry's ancestors")
            if entry.gone:
                require(entry.readers > 0, "a gone prefix entry nobody reads is still held")
            else:
                require(
                    all(self._index.get((entry.scope, digest), {}).get(number) is entry for digest in entry.digests[entry.parent_blocks :]),
                    "a prefix entry is not indexed under each digest of its own blocks",
                )

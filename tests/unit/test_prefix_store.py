"""The prefix store alone (kvpool.daemon.books.prefixes; no model, no daemon) and the digest chain that keys
it (kvpool.wire.prefix): what it holds, each outcome of an offer, one entry per prefix, delta entries (a
shared prefix held once, a child read through its parents at every length, the depth cap), LRU within its
limit (a parent outlives its children), leases, reads cut to the blocks asked, damage taking an entry's
descendants, scopes apart, and its directory (private files, adoption by identity and block size, children
linked to adopted parents, removals by reason, failed writes). States are llama.cpp sequence states in
layout, built as tests/support/fake_worker.py builds them: the K and V rows of position p are the chain
digest of the tokens up to p, so a state's bytes are a function of its tokens and a cut one can be
compared byte for byte with the state of the shorter prompt. The store's integrity check runs after every
step."""

from __future__ import annotations

import collections
import os
import pathlib
import stat

import msgspec
import numpy as np
import pytest

from kvpool.daemon.books import prefixes
from kvpool.daemon.books.integrity import IntegrityError
from kvpool.daemon.books.prefixes import FILE_SUFFIX, PrefixStore
from kvpool.daemon.books.spill import CorruptBlob
from kvpool.state.header import FORMAT_VERSION, StateHeader, StateIdentity, head_size, open_state, seal, seal_shared
from kvpool.state.sequence import check_cells
from kvpool.state.shared import SharedState
from kvpool.wire.prefix import DIGEST_BYTES, chain_digests
from tests.support.disks import failing_writes, room_again
from tests.support.fake_worker import KV_ROW_BYTES, FakeSequence, chain

BLOCK = 4
N_CTX = 64
IDENTITY = StateIdentity("ab" * 32, 0, 4, 0, "cd" * 32, "llama-cpp-python 0.3.36", 1, 1, False, 2 * KV_ROW_BYTES)
OTHER_SHARD = msgspec.structs.replace(IDENTITY, layer_stop=5)


def prompt(seed: int, length: int) -> list[int]:
    return [int(token) for token in np.random.default_rng(seed).integers(1, 30000, length)]


def state_of(tokens: list[int], seq_id: int = 0) -> bytes:
    """llama.cpp's bytes of a one-sequence state holding `tokens` (tests/support/fake_worker.FakeSequence)."""
    sequence = FakeSequence()
    sequence.open(N_CTX)
    digest = b""
    for token in tokens:
        digest = chain(digest, np.asarray([token], np.int32))
        sequence.digests.append(digest)
    return sequence.state(seq_id)


def digests_of(tokens: list[int], scope: str = "", block: int = BLOCK) -> list[bytes]:
    return chain_digests(tokens, block, scope)


def checked(store: PrefixStore) -> PrefixStore:
    store.check_integrity()
    return store


def offer(store: PrefixStore, tokens: list[int], scope: str = "", blocks: int | None = None) -> str:
    """`tokens`' state offered as its first `blocks` whole blocks (all of them by default)."""
    digests = chain_digests(tokens, store.block, scope)[:blocks]
    outcome = store.offer(scope, digests, state_of(tokens), len(tokens), N_CTX)
    checked(store)
    return outcome


def entry_bytes(blocks: int) -> int:
    """What an entry of `blocks` blocks costs (a sealed state's size depends on its length alone here)."""
    store = PrefixStore(1 << 20, BLOCK, identity=IDENTITY)
    assert offer(store, prompt(999, blocks * BLOCK)) == "stored"
    return store.bytes


def held_blocks(store: PrefixStore, tokens: list[int], scope: str = "") -> int:
    return store.holds(scope, chain_digests(tokens, store.block, scope))


def files(directory: pathlib.Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def entry_of(store: PrefixStore, tokens: list[int], scope: str = ""):
    with store.leased(scope, chain_digests(tokens, store.block, scope)) as entry:
        assert entry is not None
        return entry


# ---- the digest chain ----------------------------------------------------------------------------


def test_a_chain_continued_from_its_parents_equals_the_chain_computed_whole():
    tokens = prompt(1, 5 * BLOCK + 3)
    whole = chain_digests(tokens, BLOCK, "tenant")
    assert len(whole) == 5 and len(set(whole)) == 5 and {len(digest) for digest in whole} == {DIGEST_BYTES}  # the partial block names nothing
    for start in range(6):
        assert chain_digests(tokens, BLOCK, "tenant", start=start, parents=whole[:start]) == whole[start:]
    assert chain_digests(tokens[: 3 * BLOCK], BLOCK, "tenant") == whole[:3]  # a prompt's blocks name its prefixes
    with pytest.raises(ValueError):
        chain_digests(tokens, BLOCK, "tenant", start=2, parents=whole[:1])
    with pytest.raises(ValueError):
        chain_digests(tokens, 0)


def test_a_scope_or_a_block_size_changes_every_digest():
    tokens = prompt(2, 8 * BLOCK)
    base = chain_digests(tokens, BLOCK, "")
    for other in (chain_digests(tokens, BLOCK, "a"), chain_digests(tokens, BLOCK, " "), chain_digests(tokens, 2 * BLOCK, ""), chain_digests(tokens, BLOCK // 2, "")):
        assert not set(other) & set(base)
    assert not set(chain_digests(tokens, BLOCK, "ab")) & set(chain_digests(tokens, BLOCK, "a"))


def test_one_changed_token_changes_its_blocks_digest_and_every_later_one():
    tokens = prompt(3, 6 * BLOCK)
    changed = list(tokens)
    changed[2 * BLOCK + 1] += 1  # in block 2
    before, after = chain_digests(tokens, BLOCK), chain_digests(changed, BLOCK)
    assert before[:2] == after[:2]
    assert all(old != new for old, new in zip(before[2:], after[2:])) and not set(before[2:]) & set(after)


# ---- holding and offering ------------------------------------------------------------------------


def test_holds_counts_the_leading_blocks_some_entry_holds():
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    tokens = prompt(4, 3 * BLOCK + 2)
    assert held_blocks(store, tokens) == 0
    assert offer(store, tokens) == "stored"
    assert (len(store), store.blocks, store.bytes) == (1, 3, entry_bytes(3))
    assert held_blocks(store, tokens) == 3
    assert held_blocks(store, tokens + prompt(5, 2 * BLOCK)) == 3  # a longer prompt: its first three blocks
    assert held_blocks(store, tokens[: 2 * BLOCK]) == 2
    diverging = tokens[:BLOCK] + [tokens[BLOCK] + 1] + tokens[BLOCK + 1 :]
    assert held_blocks(store, diverging) == 1
    assert held_blocks(store, prompt(6, 3 * BLOCK)) == 0
    assert store.holds("", []) == 0


def test_offers_that_store_nothing_say_why():
    tokens = prompt(7, 2 * BLOCK + 1)
    digests = digests_of(tokens)
    off = checked(PrefixStore(0, BLOCK, identity=IDENTITY))
    assert not off.enabled and offer(off, tokens) == "off" and len(off) == 0

    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    assert store.offer("", [], state_of(tokens), len(tokens), N_CTX) == "empty"
    assert store.offer("", digests, b"\x00" * 64, len(tokens), N_CTX) == "unreadable"
    assert store.offer("", digests, state_of(tokens[:5]), 2 * BLOCK, N_CTX) == "unreadable"  # fewer positions than two blocks
    assert (len(store), store.bytes, store.evictions) == (0, 0, 0)
    checked(store)

    small = checked(PrefixStore(entry_bytes(2) - 1, BLOCK, identity=IDENTITY))
    assert offer(small, tokens) == "too large"
    assert offer(small, tokens, blocks=1) == "stored"  # one block fits
    assert (len(small), small.blocks, small.bytes) == (1, 1, entry_bytes(1))


def test_a_longer_offer_becomes_the_shorter_entrys_child_and_a_shorter_one_is_held():
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    tokens = prompt(8, 4 * BLOCK)
    assert offer(store, tokens, blocks=2) == "stored"
    assert offer(store, tokens, blocks=2) == "held"
    assert offer(store, tokens) == "stored"
    # the two-block entry stays: the longer one holds its own two blocks only, and the two count as one prefix
    assert (len(store), store.entries, store.blocks, store.bytes) == (1, 2, 4, 2 * entry_bytes(2))
    assert offer(store, tokens, blocks=3) == "held" and offer(store, tokens) == "held"
    assert (store.entries, store.blocks) == (2, 4) and held_blocks(store, tokens) == 4
    child = entry_of(store, tokens)
    assert (child.blocks, child.parent_blocks, child.parent.blocks) == (4, 2, 2)
    for blocks in range(1, 5):
        assert store.read(child, blocks) == state_of(tokens[: blocks * BLOCK])
    entry = entry_of(store, tokens[: 2 * BLOCK])
    assert entry is child.parent and store.read(entry, 2) == state_of(tokens[: 2 * BLOCK])


def test_branches_of_one_chain_keep_the_blocks_they_share_when_one_leaves():
    shared = prompt(9, 2 * BLOCK)
    first, second, third = (shared + prompt(seed, BLOCK) for seed in (10, 11, 12))
    store = checked(PrefixStore(2 * entry_bytes(3), BLOCK, identity=IDENTITY))
    assert offer(store, first) == "stored" and offer(store, second) == "stored"
    assert len(store) == 2 and held_blocks(store, shared + prompt(13, BLOCK)) == 2
    assert offer(store, first) == "held"  # touched: `second` is the least recently used
    assert offer(store, prompt(14, 3 * BLOCK)) == "stored"
    assert store.evictions == 1 and held_blocks(store, second) == 2  # `second`'s own block went, the shared ones are first's
    assert held_blocks(store, first) == 3 and held_blocks(store, shared + prompt(15, BLOCK)) == 2
    with store.leased("", digests_of(shared)) as entry:
        assert entry is not None and store.read(entry, 2) == state_of(shared)
    checked(store)


def test_entries_are_evicted_least_recently_used_within_the_limit():
    size = entry_bytes(2)
    store = checked(PrefixStore(3 * size, BLOCK, identity=IDENTITY))
    a, b, c, d, e = (prompt(20 + index, 2 * BLOCK) for index in range(5))
    for tokens in (a, b, c):
        assert offer(store, tokens) == "stored"
    assert offer(store, a) == "held"  # a touched by an offer
    with store.leased("", digests_of(b)) as entry:  # b touched by a read
        assert entry is not None
    assert offer(store, d) == "stored"
    assert [held_blocks(store, tokens) for tokens in (a, b, c, d)] == [2, 2, 0, 2] and store.evictions == 1
    assert offer(store, e) == "stored"
    assert [held_blocks(store, tokens) for tokens in (a, b, d, e)] == [0, 2, 2, 2] and store.evictions == 2
    assert (len(store), store.bytes) == (3, 3 * size)


def test_no_room_when_every_entry_it_would_push_out_is_being_read():
    size = entry_bytes(2)
    store = checked(PrefixStore(2 * size, BLOCK, identity=IDENTITY))
    a, b, c = (prompt(30 + index, 2 * BLOCK) for index in range(3))
    assert offer(store, a) == "stored" and offer(store, b) == "stored"
    with store.leased("", digests_of(a)) as leased_a, store.leased("", digests_of(b)) as leased_b:
        assert leased_a is not None and leased_b is not None
        assert offer(store, c) == "no room"
        assert (len(store), store.bytes, store.evictions, held_blocks(store, c)) == (2, 2 * size, 0, 0)  # nothing pushed out
    with store.leased("", digests_of(b)) as leased_b:
        assert offer(store, a) == "held"  # b is the least recently used, but it is read: a goes
        assert offer(store, c) == "stored"
        assert [held_blocks(store, tokens) for tokens in (a, b, c)] == [0, 2, 2] and store.evictions == 1
    checked(store)


def test_an_entry_extended_while_it_is_read_stays_and_its_child_reads_through_it():
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    tokens = prompt(40, 3 * BLOCK)
    assert offer(store, tokens, blocks=2) == "stored"
    with store.leased("", digests_of(tokens)[:2]) as shorter:
        assert shorter is not None
        assert offer(store, tokens) == "stored"
        assert not shorter.gone and store.entries == 2 and store.bytes == entry_bytes(2) + entry_bytes(1)
        assert store.read(shorter, 2) == state_of(tokens[: 2 * BLOCK])
        with store.leased("", digests_of(tokens)) as longer:
            assert longer is not None and longer.parent is shorter and shorter.readers == 2
            assert store.read(longer, 3) == state_of(tokens)
        checked(store)
    assert shorter.readers == 0 and (store.entries, store.blocks) == (2, 3)
    checked(store)


def test_a_child_needs_room_for_its_own_blocks_only():
    one, two, three = entry_bytes(1), entry_bytes(2), entry_bytes(3)
    store = checked(PrefixStore(one + two + one, BLOCK, identity=IDENTITY))
    other, tokens = prompt(41, BLOCK), prompt(42, 3 * BLOCK)
    assert offer(store, other) == "stored" and offer(store, tokens, blocks=2) == "stored"
    assert store.bytes == one + two and one + three > store.limit - two  # a whole three-block entry would push `other` out
    assert offer(store, tokens) == "stored"  # a child of one block beside its parent: nothing pushed out
    assert store.evictions == 0 and held_blocks(store, other) == 1 and held_blocks(store, tokens) == 3
    assert (store.entries, store.bytes) == (3, one + two + one)


def test_a_read_is_cut_to_the_blocks_asked():
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    tokens = prompt(43, 4 * BLOCK + 3)
    assert offer(store, tokens) == "stored"  # a state of 19 positions cut to 16
    with store.leased("", digests_of(tokens)) as entry:
        assert entry is not None
        for blocks in range(1, 5):
            payload = store.read(entry, blocks)
            assert check_cells(payload, 0) == blocks * BLOCK
            assert payload == state_of(tokens[: blocks * BLOCK])
    checked(store)


def test_a_damaged_stored_state_raises_corrupt_blob_and_its_entry_is_gone(tmp_path):
    directory = tmp_path / "prefixes"
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    damaged, foreign = prompt(44, 2 * BLOCK), prompt(45, 2 * BLOCK)
    assert offer(store, damaged) == "stored" and offer(store, foreign) == "stored"
    assert len(files(directory)) == 2
    with store.leased("", digests_of(damaged)) as entry:
        flipped = bytearray(entry.sealed)
        flipped[len(flipped) // 2] ^= 0x40
        entry.sealed = bytes(flipped)
        with pytest.raises(CorruptBlob) as raised:
            store.read(entry, 2)
        assert not raised.value.mismatch and held_blocks(store, damaged) == 0
        checked(store)
    assert len(store) == 1 and store.bytes == entry_bytes(2) and len(files(directory)) == 1
    with store.leased("", digests_of(foreign)) as entry:  # sealed by another shard's daemon
        header = StateHeader(FORMAT_VERSION, OTHER_SHARD, "prefix:x", 0, 2 * BLOCK, N_CTX, 0.0, 0.0, len(state_of(foreign)))
        entry.sealed = seal(header, state_of(foreign))
        with pytest.raises(CorruptBlob) as raised:
            store.read(entry, 1)
        assert raised.value.mismatch
    assert (len(store), store.bytes, files(directory)) == (0, 0, [])
    with store.leased("", digests_of(foreign)) as entry:
        assert entry is None
    checked(store)


def test_scopes_never_share_an_entry():
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    tokens = prompt(46, 2 * BLOCK)
    assert offer(store, tokens, scope="a") == "stored"
    assert held_blocks(store, tokens, scope="a") == 2
    assert held_blocks(store, tokens, scope="b") == 0
    assert store.holds("b", digests_of(tokens, "a")) == 0  # scope a's digests asked in scope b
    with store.leased("b", digests_of(tokens, "a")) as entry:
        assert entry is None
    assert offer(store, tokens, scope="b") == "stored"
    assert len(store) == 2 and held_blocks(store, tokens, scope="") == 0
    longer = tokens + prompt(47, BLOCK)
    assert offer(store, longer, scope="b") == "stored" and entry_of(store, longer, scope="b").parent.scope == "b"
    assert held_blocks(store, longer, scope="a") == 2 and held_blocks(store, longer, scope="b") == 3


def test_the_integrity_check_sees_books_that_do_not_balance():
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    assert offer(store, prompt(47, BLOCK)) == "stored"
    store.bytes += 1
    with pytest.raises(IntegrityError):
        store.check_integrity()
    store.bytes -= 1
    store._index.clear()
    with pytest.raises(IntegrityError):
        store.check_integrity()


# ---- its directory -------------------------------------------------------------------------------


def test_every_entry_is_a_private_file_and_an_evicted_or_covered_entrys_file_goes(tmp_path):
    directory = tmp_path / "prefixes"
    size = entry_bytes(2)
    store = checked(PrefixStore(2 * size, BLOCK, identity=IDENTITY, directory=directory))
    assert not directory.exists()  # made with the first entry: a spill dir without prefixes holds no folder for them
    a, b, c = (prompt(50 + index, 2 * BLOCK) for index in range(3))
    assert offer(store, a) == "stored" and offer(store, b) == "stored"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    names = files(directory)
    assert len(names) == 2 and all(prefixes.OWN_FILE.fullmatch(name) and name.endswith(FILE_SUFFIX) for name in names)
    assert {stat.S_IMODE((directory / name).stat().st_mode) for name in names} == {0o600}
    path_a = entry_of(store, a).path
    assert offer(store, b) == "held" and offer(store, c) == "stored"  # a is evicted
    assert not path_a.exists() and len(files(directory)) == 2
    parent = entry_of(store, c).path
    assert offer(store, c + prompt(53, 1), blocks=2) == "held"
    store.close()
    store = checked(PrefixStore(3 * size, BLOCK, identity=IDENTITY, directory=directory))
    assert store.adopt() == collections.Counter(adopted=2)
    assert offer(store, c + prompt(54, BLOCK)) == "stored"  # c's child: c's file stays, the child's is its own
    assert parent.exists() and len(files(directory)) == 3 and store.entries == 3
    child = entry_of(store, c + prompt(54, BLOCK))
    assert child.parent.path == parent and child.path != parent
    assert offer(store, a) == "stored"  # the limit of three two-block entries: b (the oldest, childless) goes
    assert store.evictions == 1 and held_blocks(store, b) == 0 and held_blocks(store, c) == 2 and len(files(directory)) == 3


def test_close_keeps_the_files_and_a_store_of_the_same_identity_adopts_them(tmp_path):
    directory = tmp_path / "prefixes"
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    a, b = prompt(60, 2 * BLOCK), prompt(61, 3 * BLOCK + 1)
    assert offer(store, a) == "stored" and offer(store, b, scope="t") == "stored"
    written = files(directory)
    store.close()
    checked(store)
    assert (len(store), store.bytes, files(directory)) == (0, 0, written)

    again = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    assert again.adopt() == collections.Counter(adopted=2)
    checked(again)
    assert (held_blocks(again, a), held_blocks(again, b, scope="t"), held_blocks(again, b)) == (2, 3, 0)
    assert (len(again), again.blocks, again.bytes) == (2, 5, entry_bytes(2) + entry_bytes(3))
    assert again.read(entry_of(again, b, scope="t"), 3) == state_of(b[: 3 * BLOCK])
    numbers = {entry.number for entry in again._entries.values()}
    c = prompt(62, BLOCK)
    assert offer(again, c) == "stored"
    assert entry_of(again, c).number > max(numbers) and len(files(directory)) == 3  # no adopted file overwritten
    assert set(written) < set(files(directory))


def test_files_of_another_identity_or_block_size_and_damaged_ones_are_removed_by_reason(tmp_path):
    directory = tmp_path / "prefixes"
    ours, foreign, other_block = prompt(70, 2 * BLOCK), prompt(71, 2 * BLOCK), prompt(72, 2 * BLOCK)
    for identity, block, tokens in ((IDENTITY, BLOCK, ours), (OTHER_SHARD, BLOCK, foreign), (IDENTITY, 2 * BLOCK, other_block)):
        writer = checked(PrefixStore(1 << 20, block, identity=identity, directory=directory))
        assert offer(writer, tokens) == "stored"
        writer.close()
    own = "prefix-00000001" + FILE_SUFFIX  # the first writer's: ours
    data = (directory / own).read_bytes()
    meta_end = len(prefixes.FILE_MAGIC) + 4 + int.from_bytes(data[len(prefixes.FILE_MAGIC) : len(prefixes.FILE_MAGIC) + 4], "little")
    damaged = {
        "prefix-00000010": data[:-8],  # the sealed state truncated
        "prefix-00000011": data[: meta_end - 2],  # the meta truncated
        "prefix-00000012": data[:meta_end] + bytes([data[meta_end] ^ 1]) + data[meta_end + 1 :],  # a bad meta CRC
        "prefix-00000013": data[: meta_end - 1] + bytes([data[meta_end - 1] ^ 1]) + data[meta_end:],  # a meta that fails its CRC
        "prefix-00000014": data[:-20] + bytes([data[-20] ^ 1]) + data[-19:],  # the sealed state fails its CRC
        "prefix-00000015": b"KVPSTAT1" + data[8:],  # not a prefix file
        "prefix-00000016": data,  # the same entry twice
    }
    for name, content in damaged.items():
        (directory / (name + FILE_SUFFIX)).write_bytes(content)
    (directory / "notes.txt").write_bytes(b"not the store's")
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    counts = store.adopt()
    checked(store)
    assert counts == collections.Counter({
        "adopted": 1, "another shard, build or KV layout": 1, "another --prefix-block": 1, "corrupt": 4, "truncated": 1,
        "not a prefix file": 1, "held twice": 1,
    })
    assert sum(counts.values()) == 10
    assert len(store) == 1 and held_blocks(store, ours) == 2 and store.read(entry_of(store, ours), 2) == state_of(ours)
    assert files(directory) == sorted([own, "notes.txt"])  # of two equal files the first by name is adopted; a file not named as the store's stays


def test_adoption_keeps_the_newest_entries_the_limit_holds_and_they_stay_older_than_new_offers(tmp_path):
    directory = tmp_path / "prefixes"
    size = entry_bytes(2)
    a, b, c, d = (prompt(80 + index, 2 * BLOCK) for index in range(4))
    writer = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    for tokens in (a, b, c):
        assert offer(writer, tokens) == "stored"
    writer.close()
    store = checked(PrefixStore(2 * size, BLOCK, identity=IDENTITY, directory=directory))
    assert store.adopt() == collections.Counter({"adopted": 2, "no room": 1})
    checked(store)
    assert [held_blocks(store, tokens) for tokens in (a, b, c)] == [0, 2, 2] and len(files(directory)) == 2
    assert store.bytes == 2 * size <= store.limit
    assert offer(store, d) == "stored"  # b, the older adopted entry, goes first
    assert [held_blocks(store, tokens) for tokens in (b, c, d)] == [0, 2, 2] and len(files(directory)) == 2


def test_adoption_keeps_one_entry_per_prefix(tmp_path):
    tokens = prompt(90, 3 * BLOCK)
    for order, expected, entries in (((2, 3, 3), {"adopted": 1, "held twice": 2}, 1), ((3, 2), {"adopted": 2}, 2)):
        directory = tmp_path / "-".join(map(str, order))
        for blocks in order:  # each store's one entry is whole; the last written is the newest
            writer = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
            assert offer(writer, tokens, blocks=blocks) == "stored"
            writer.close()
        store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
        # whole entries are adopted newest first: one the adopted hold is held twice; an older longer one is
        # adopted beside a newer shorter one, whole (adoption never rewrites a file as a delta)
        assert store.adopt() == collections.Counter(expected)
        checked(store)
        assert (len(store), store.entries, held_blocks(store, tokens), len(files(directory))) == (1, entries, 3, entries)
        assert store.read(entry_of(store, tokens), 3) == state_of(tokens)


def test_a_write_an_earlier_run_left_unfinished_is_removed_and_takes_no_number(tmp_path):
    directory = tmp_path / "prefixes"
    directory.mkdir(mode=0o700)
    (directory / ("prefix-00000001" + FILE_SUFFIX + ".partial")).write_bytes(b"half a file")
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    assert store.adopt() == collections.Counter({"unfinished write": 1})
    assert offer(store, prompt(91, BLOCK)) == "stored"
    assert store.disk_failures == 0 and files(directory) == ["prefix-00000001" + FILE_SUFFIX]


def test_a_failed_write_is_counted_and_changes_nothing(tmp_path, monkeypatch):
    directory = tmp_path / "prefixes"
    size = entry_bytes(2)
    store = checked(PrefixStore(2 * size, BLOCK, identity=IDENTITY, directory=directory))
    a, b, c = (prompt(100 + index, 2 * BLOCK) for index in range(3))
    assert offer(store, a) == "stored" and offer(store, b) == "stored"

    def refuse(path: pathlib.Path, data: bytes) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(prefixes, "_write_file", refuse)
    assert offer(store, c) not in ("stored", "held")
    assert store.disk_failures == 1 and store.evictions == 0  # nothing was pushed out for it
    assert [held_blocks(store, tokens) for tokens in (a, b, c)] == [2, 2, 0] and len(files(directory)) == 2
    monkeypatch.undo()
    assert offer(store, c) == "stored"
    assert [held_blocks(store, tokens) for tokens in (a, b, c)] == [0, 2, 2] and len(files(directory)) == 2
    assert store.disk_failures == 1 and store.evictions == 1


def test_a_write_to_a_full_file_system_stores_nothing_and_leaves_no_file(tmp_path):
    directory = tmp_path / "prefixes"
    with failing_writes(directory) as break_writes:
        store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
        kept, refused = prompt(110, 2 * BLOCK), prompt(111, 2 * BLOCK)
        assert offer(store, kept) == "stored"
        break_writes()
        before = files(directory)
        assert offer(store, refused) not in ("stored", "held")
        assert store.disk_failures == 1 and (len(store), held_blocks(store, refused), held_blocks(store, kept)) == (1, 0, 2)
        assert files(directory) == before  # no .partial left
        room_again(directory)
        assert offer(store, refused) == "stored" and len(store) == 2 and store.disk_failures == 1
        store.close()
        assert len([name for name in files(directory) if name.endswith(FILE_SUFFIX)]) == 2


def test_a_store_without_a_limit_creates_no_directory_and_adopts_nothing(tmp_path):
    directory = tmp_path / "prefixes"
    store = checked(PrefixStore(0, BLOCK, identity=IDENTITY, directory=directory))
    assert not directory.exists() and store.adopt() == collections.Counter()
    os.mkdir(directory, 0o700)
    (directory / ("prefix-00000001" + FILE_SUFFIX)).write_bytes(b"kept for a store that has a limit")
    assert PrefixStore(0, BLOCK, identity=IDENTITY, directory=directory).adopt() == collections.Counter()
    assert files(directory) == ["prefix-00000001" + FILE_SUFFIX]


# ---- delta entries: a shared prefix held once ----------------------------------------------------


def test_a_system_prompt_four_prompts_share_is_held_once():
    system = prompt(120, 3 * BLOCK)
    messages = [prompt(121 + index, BLOCK + 2) for index in range(4)]  # each its own block, and a partial one
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    assert offer(store, system) == "stored"
    for message in messages:
        assert offer(store, system + message) == "stored"
    # one whole entry of the system prompt's 3 blocks and 4 deltas of one block each (a child's sealed state of
    # b blocks costs what a whole one of b blocks does here: its size depends on its cell count alone)
    assert store.bytes == entry_bytes(3) + 4 * entry_bytes(1) < 4 * entry_bytes(4)
    assert (len(store), store.entries, store.blocks) == (4, 5, 3 + 4)
    parent = entry_of(store, system)
    assert sorted(child.parent_blocks for child in parent.children.values()) == [3] * 4
    for message in messages:
        child = entry_of(store, system + message)
        assert child.parent is parent and held_blocks(store, system + message) == 4
        assert [store.read(child, blocks) for blocks in range(1, 5)] == [state_of((system + message)[: blocks * BLOCK]) for blocks in range(1, 5)]


def test_every_length_of_a_child_and_a_grandchild_reads_as_the_whole_state():
    tokens = prompt(130, 6 * BLOCK + 1)
    branch = tokens[: 2 * BLOCK] + prompt(131, 3 * BLOCK)
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    assert offer(store, tokens, blocks=1) == "stored"
    assert offer(store, tokens, blocks=3) == "stored" and offer(store, tokens) == "stored"  # a child, then its child
    assert offer(store, branch) == "stored"  # branches off the child at block 2: the child's child too
    grandchild, other = entry_of(store, tokens), entry_of(store, branch)
    assert (grandchild.depth, grandchild.parent_blocks, grandchild.parent.parent_blocks) == (2, 3, 1)
    assert (other.parent is grandchild.parent, other.parent_blocks, other.own_blocks) == (True, 2, 3)
    assert store.blocks == 6 + 3 and store.bytes == entry_bytes(1) + entry_bytes(2) + entry_bytes(3) + entry_bytes(3)
    for entry, held in ((grandchild, tokens), (other, branch)):
        for blocks in range(1, entry.blocks + 1):
            payload = store.read(entry, blocks)
            assert check_cells(payload, 0) == blocks * BLOCK and payload == state_of(held[: blocks * BLOCK])
    checked(store)


def test_a_read_with_room_is_a_memfd_holding_the_same_bytes_sealed_in_place_and_bytes_without_a_descriptor(monkeypatch):
    """A prefix admission reads into a SharedState (written once, with room for the seal around it); its payload
    is byte for byte what a plain read gives, for a whole entry, a cut one and a child read through its parent;
    where this process may keep no more memfds, bytes."""
    system, tokens = prompt(137, 2 * BLOCK), prompt(137, 2 * BLOCK) + prompt(138, 2 * BLOCK)
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    assert offer(store, system) == "stored" and offer(store, tokens) == "stored"
    child, parent = entry_of(store, tokens), entry_of(store, system)
    header = StateHeader(version=FORMAT_VERSION, identity=IDENTITY, session_id="s", epoch=1, length=0, n_ctx=N_CTX, saved_at=0.0, last_used=0.0, payload_bytes=0)
    for entry, blocks in ((parent, 2), (parent, 1), (child, 4), (child, 3)):
        plain = store.read(entry, blocks)
        sealed_as = msgspec.structs.replace(header, length=blocks * BLOCK, payload_bytes=len(plain))
        shared = store.read(entry, blocks, room=(head_size(sealed_as), 4))
        try:
            assert isinstance(plain, bytes) and isinstance(shared, SharedState) and not shared.sealed
            assert (shared.head, shared.tail, shared.payload_bytes) == (head_size(sealed_as), 4, len(plain)) and bytes(shared.payload) == plain
            assert seal_shared(sealed_as, shared) and shared.sealed
            assert open_state(bytes(shared.view), IDENTITY) == (sealed_as, plain)
        finally:
            shared.close()
    monkeypatch.setattr(SharedState, "limit", SharedState.open_count())
    assert store.read(child, 4, room=(head_size(header), 4)) == state_of(tokens)
    checked(store)


def test_a_child_saved_by_another_sequence_reads_as_its_parents_sequence():
    """Batched mode: each session's state names its own sequence; a read joins them as the parent's."""
    system, tokens = prompt(135, 2 * BLOCK), prompt(135, 2 * BLOCK) + prompt(136, 2 * BLOCK)
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    assert store.offer("", digests_of(system), state_of(system, seq_id=2), len(system), N_CTX) == "stored"
    assert store.offer("", digests_of(tokens), state_of(tokens, seq_id=5), len(tokens), N_CTX) == "stored"
    child = entry_of(store, tokens)
    assert child.parent_blocks == 2
    assert [store.read(child, blocks) for blocks in (1, 2, 3, 4)] == [state_of(tokens[: blocks * BLOCK], seq_id=2) for blocks in (1, 2, 3, 4)]
    checked(store)


def test_a_chain_deeper_than_the_cap_is_stored_whole():
    tokens = prompt(140, (prefixes.MAX_DEPTH + 3) * BLOCK)
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY))
    depths = []
    for blocks in range(1, prefixes.MAX_DEPTH + 4):
        assert offer(store, tokens, blocks=blocks) == "stored"
        depths.append(entry_of(store, tokens[: blocks * BLOCK]).depth)
    assert depths == list(range(prefixes.MAX_DEPTH + 1)) + [0, 1]  # the tenth offer would be 9 parents deep: whole
    assert store.bytes == (prefixes.MAX_DEPTH + 2) * entry_bytes(1) + entry_bytes(prefixes.MAX_DEPTH + 2)
    deepest = entry_of(store, tokens[: (prefixes.MAX_DEPTH + 1) * BLOCK])
    assert [store.read(deepest, blocks) for blocks in range(1, deepest.blocks + 1)] == [state_of(tokens[: blocks * BLOCK]) for blocks in range(1, deepest.blocks + 1)]
    last = entry_of(store, tokens)
    assert store.read(last, last.blocks) == state_of(tokens)


def test_a_parent_is_not_evicted_while_it_has_a_child_and_evicting_its_children_frees_it():
    one, two = entry_bytes(1), entry_bytes(2)
    store = checked(PrefixStore(two + 2 * one, BLOCK, identity=IDENTITY))
    parent, first, second = prompt(150, 2 * BLOCK), prompt(151, BLOCK), prompt(152, BLOCK)
    assert offer(store, parent) == "stored" and offer(store, parent + first) == "stored"  # the parent, then its child
    assert offer(store, prompt(153, BLOCK)) == "stored"  # fills the limit: the parent is the least recently used
    assert offer(store, second) == "stored"  # room for one block: the child goes, not its older parent
    assert store.evictions == 1 and held_blocks(store, parent + first) == 2 and held_blocks(store, parent) == 2
    assert offer(store, parent + first) == "stored" and store.evictions == 2  # the child again: the block of 153 goes
    with store.leased("", digests_of(parent + first)) as child:  # a lease pins the child and its parent
        assert child is not None and child.parent.readers == 1
        assert offer(store, prompt(154, 2 * BLOCK)) == "no room"  # `second` alone is free: one block of room
        assert store.evictions == 2 and store.entries == 3
    assert offer(store, second) == "held"  # the least recently used first: the parent, its child, `second`
    assert offer(store, prompt(155, 2 * BLOCK)) == "stored"  # the child goes, and then its parent may: room for two blocks
    assert store.evictions == 4 and held_blocks(store, parent) == 0 and held_blocks(store, second) == 1
    assert (store.entries, store.bytes) == (2, two + one)


def test_a_damaged_parent_takes_its_children_and_a_damaged_child_only_its_own(tmp_path):
    directory = tmp_path / "prefixes"
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    system, other = prompt(160, 2 * BLOCK), prompt(161, 2 * BLOCK)
    children = [system + prompt(162 + index, BLOCK) for index in range(3)]
    for tokens in [system, other, *children, children[0] + prompt(165, BLOCK)]:
        assert offer(store, tokens) == "stored"
    assert store.entries == 6 and len(files(directory)) == 6

    def damage(entry) -> None:
        flipped = bytearray(entry.sealed)
        flipped[len(flipped) // 2] ^= 0x40
        entry.sealed = bytes(flipped)

    damage(entry_of(store, children[2]))  # a child alone: its parent and its siblings stay
    with pytest.raises(CorruptBlob):
        store.read(entry_of(store, children[2]), 3)
    assert store.entries == 5 and held_blocks(store, children[2]) == 2 and len(files(directory)) == 5
    checked(store)
    with store.leased("", digests_of(children[1])) as reader:  # one child read while its parent is found damaged
        damage(entry_of(store, system))
        with pytest.raises(CorruptBlob) as raised:
            store.read(entry_of(store, children[0] + prompt(165, BLOCK)), 4)
        assert not raised.value.mismatch
        assert reader.gone and reader.parent.gone and [held_blocks(store, tokens) for tokens in (system, *children)] == [0, 0, 0, 0]
        assert store.entries == 3 and len(files(directory)) == 3  # the read child and its parent wait for the reader
        checked(store)
    assert (store.entries, held_blocks(store, other), len(files(directory))) == (1, 2, 1)
    assert store.bytes == entry_bytes(2)
    checked(store)


def test_adoption_links_children_to_their_parents_and_removes_a_child_without_one(tmp_path):
    directory = tmp_path / "prefixes"
    system = prompt(170, 2 * BLOCK)
    first, second = system + prompt(171, BLOCK), system + prompt(172, 2 * BLOCK)
    writer = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    for tokens in (system, first, second, first + prompt(173, BLOCK)):
        assert offer(writer, tokens) == "stored"
    grandchild_path = entry_of(writer, first + prompt(173, BLOCK)).path
    writer.close()
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    assert store.adopt() == collections.Counter(adopted=4)
    checked(store)
    grandchild = entry_of(store, first + prompt(173, BLOCK))
    assert grandchild.path == grandchild_path and grandchild.parent is entry_of(store, first) and grandchild.parent.parent is entry_of(store, system)
    assert store.bytes == entry_bytes(2) + entry_bytes(1) + entry_bytes(2) + entry_bytes(1)
    for tokens in (first + prompt(173, BLOCK), second):
        entry = entry_of(store, tokens)
        assert [store.read(entry, blocks) for blocks in range(1, entry.blocks + 1)] == [state_of(tokens[: blocks * BLOCK]) for blocks in range(1, entry.blocks + 1)]
    parent_path = entry_of(store, system).path
    store.close()

    parent_path.unlink()  # the parent's file lost: its children (and theirs) have no parent to read through
    again = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    assert again.adopt() == collections.Counter({"no parent": 3})
    checked(again)
    assert (again.entries, again.bytes, files(directory)) == (0, 0, [])


def test_a_child_file_whose_cells_are_not_its_range_is_removed(tmp_path):
    directory = tmp_path / "prefixes"
    system = prompt(180, 2 * BLOCK)
    writer = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    assert offer(writer, system) == "stored" and offer(writer, system + prompt(181, BLOCK)) == "stored"
    path = entry_of(writer, system + prompt(181, BLOCK)).path
    writer.close()
    data = path.read_bytes()
    size = int.from_bytes(data[len(prefixes.FILE_MAGIC) : len(prefixes.FILE_MAGIC) + 4], "little")
    start = len(prefixes.FILE_MAGIC) + 4
    meta = msgspec.msgpack.decode(data[start : start + size], type=prefixes.PrefixMeta)
    for parent_blocks in (1, 0):  # a delta of [8, 12) named as one of [4, 12), then as a whole entry
        forged = msgspec.msgpack.encode(msgspec.structs.replace(meta, parent_blocks=parent_blocks))
        crc = prefixes.google_crc32c.value(forged).to_bytes(4, "little")
        path.write_bytes(data[:len(prefixes.FILE_MAGIC)] + len(forged).to_bytes(4, "little") + forged + crc + data[start + size + 4 :])
        store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
        assert store.adopt() == collections.Counter({"adopted": 1, "cells out of place": 1})
        assert store.entries == 1 and not path.exists()
        store.close()
        path.write_bytes(data)
    store = checked(PrefixStore(1 << 20, BLOCK, identity=IDENTITY, directory=directory))
    assert store.adopt() == collections.Counter(adopted=2)

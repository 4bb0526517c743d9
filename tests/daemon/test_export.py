"""Export and Import: a session's sealed state moves between two daemons of the same shard and continues
bit-exactly; an imported state that is not this shard's, damaged, out of order or too large is refused with a
typed error and changes nothing. The books of the transfers (kvpool.daemon.books.in_transit) with fake bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import msgspec
import numpy as np
import pytest

from kvpool.client.aio import AsyncClient
from kvpool.client.client import KvpoolError
from kvpool.client.messages import IMPORT_FRAME_ROOM, Call, import_calls, import_chunk_bytes
from kvpool.daemon.books.in_transit import ExportCache, ExportsFull, ImportBuffers, TransferRefused
from kvpool.daemon.config import MIN_EXPORT_CHUNK_BYTES, ServeConfig
from kvpool.state.header import open_state, read_header, seal
from kvpool.state.sequence import parse_state, write_state
from kvpool.wire.protocol import Done, Export, Exported, Import
from tests.support.daemons import HANG_GUARD_S, DaemonProcess
from tests.support.daemons import checked as _checked
from tests.support.daemons import refused as _refused

pytestmark = pytest.mark.timeout(3600)

N_CTX = 64  # the sessions' context, and the importing daemons' --n-ctx
WIDE_N_CTX = 128  # the exporting daemon's --n-ctx: a session of this context does not fit an importer of N_CTX
CHUNK = 4096  # the exporting daemon's --export-chunk-bytes: every state spans several chunks
IMPORT_CAP = 2 * 1024**2  # the importing daemon's --max-import-bytes
IMPORTER_MAX_REQUEST = 16 * 1024  # the importing daemon's --max-request-bytes: the client's Import chunks fit it


def _serve(model, socket_dir, name, *options):
    return DaemonProcess(model, socket_dir / f"{name}.sock", "--threads", "1", "--max-sessions", "2", *options)






def _sessions(client) -> dict[str, tuple[int, int, str]]:
    return {row.session_id: (row.epoch, row.length, row.tier) for row in _checked(client).sessions}


def _round_trip(source, target, prompt, session_id="moved"):
    """Export a hot session from `source` (it stays hot), import it into `target`; both append the next token:
    the rows must be equal. Returns the exported state."""
    source.append(session_id, 1, 0, tokens=prompt, n_ctx=N_CTX)
    state = source.export_state(session_id, 1)
    header = read_header(state)
    assert (header.session_id, header.epoch, header.length, header.n_ctx) == (session_id, 1, len(prompt), N_CTX)
    assert _sessions(source)[session_id] == (1, len(prompt), "hot")
    assert target.import_state(session_id, 1, state, chunk_bytes=CHUNK) == len(prompt)
    assert _sessions(target)[session_id] == (1, len(prompt), "ram")
    expected = source.append(session_id, 1, len(prompt), tokens=[42])
    assert not expected.restored  # it stayed hot through the export
    got = target.append(session_id, 1, len(prompt), tokens=[42])
    assert got.restored and got.length == len(prompt) + 1
    assert np.array_equal(got.rows, expected.rows)
    return state


def _continue_alike(source, target, session_id, position, token):
    """Both daemons append `token` at `position` (epoch 1): the rows must be equal; then both release the session."""
    expected = source.append(session_id, 1, position, tokens=[token])
    assert np.array_equal(target.append(session_id, 1, position, tokens=[token]).rows, expected.rows)
    source.release(session_id, 1)
    target.release(session_id, 1)


# ---- two daemons of the first shard, process mode ----------------------------------------------------


@pytest.fixture(scope="module")
def process_pair(shards, socket_dir):
    source = _serve(shards[0].path, socket_dir, "exporter", "--n-ctx", str(WIDE_N_CTX), "--export-chunk-bytes", str(CHUNK))
    target = _serve(
        shards[0].path, socket_dir, "importer", "--n-ctx", str(N_CTX), "--max-import-bytes", str(IMPORT_CAP), "--max-request-bytes", str(IMPORTER_MAX_REQUEST),
    )
    try:
        yield source, target
    finally:
        source.stop()
        target.stop()


def test_a_hot_session_moves_to_another_daemon_and_continues_bit_exactly(process_pair, prompt_ids):
    source_daemon, target_daemon = process_pair
    with source_daemon.client() as source, target_daemon.client() as target:
        before = _checked(source).counters
        prompt = prompt_ids[0][:12]
        state = _round_trip(source, target, prompt)
        chunks = math.ceil(len(state) / CHUNK)
        assert chunks > 1
        counters = _checked(source).counters
        assert counters["exports"] - before.get("exports", 0) == 1
        assert counters["export_chunks"] - before.get("export_chunks", 0) == chunks  # each reply held CHUNK bytes at most
        assert _checked(target).counters["import_chunks"] >= chunks
        # the next decode steps keep agreeing on both daemons
        for step in range(2):
            position = len(prompt) + 1 + step
            assert np.array_equal(target.append("moved", 1, position, tokens=[7 + step]).rows, source.append("moved", 1, position, tokens=[7 + step]).rows)
        source.release("moved", 1)
        target.release("moved", 1)


def test_a_parked_session_exports_from_the_store(process_pair, prompt_ids):
    source_daemon, target_daemon = process_pair
    prompt = prompt_ids[1][:12]
    with source_daemon.client() as source, target_daemon.client() as target:
        source.append("parked", 1, 0, tokens=prompt, n_ctx=N_CTX)
        source.park("parked", 1)
        state = source.export_state("parked", 1)
        assert _sessions(source)["parked"] == (1, len(prompt), "ram")  # still parked: read, not restored
        before = _checked(target).counters.get("import_chunks", 0)
        assert target.import_state("parked", 1, state) == len(prompt)  # chunks sized by the importer's request limit
        chunk = import_chunk_bytes(IMPORTER_MAX_REQUEST)
        assert chunk == IMPORTER_MAX_REQUEST - IMPORT_FRAME_ROOM
        assert _checked(target).counters["import_chunks"] - before == math.ceil(len(state) / chunk) > 1
        _continue_alike(source, target, "parked", len(prompt), 3)


def test_the_async_client_exports_and_imports_the_same_way(process_pair, prompt_ids):
    source_daemon, target_daemon = process_pair
    prompt = prompt_ids[1][:9]

    async def move() -> tuple[bytes, int]:
        async with AsyncClient(source_daemon.socket) as source, AsyncClient(target_daemon.socket) as target:
            await source.append("async", 1, 0, tokens=prompt, n_ctx=N_CTX)
            state = await source.export_state("async", 1)
            return state, await target.import_state("async", 1, state)

    state, length = asyncio.run(asyncio.wait_for(move(), HANG_GUARD_S))
    assert length == len(prompt) == read_header(state).length
    with source_daemon.client() as source, target_daemon.client() as target:
        _continue_alike(source, target, "async", len(prompt), 5)


def test_damaged_out_of_order_oversized_and_stale_imports_change_nothing(process_pair, prompt_ids):
    source_daemon, target_daemon = process_pair
    prompt = prompt_ids[0][:10]
    with source_daemon.client() as source, target_daemon.client() as target:
        source.append("victim", 1, 0, tokens=prompt, n_ctx=N_CTX)
        state = source.export_state("victim", 1)
        assert target.import_state("bystander", 1, state) == len(prompt)  # an import under another id: allowed
        target.append("bystander", 1, len(prompt), tokens=[9])
        sessions_before = _sessions(target)
        workers_before = sorted(target_daemon.worker_pids())

        def refused(data: bytes, session_id: str = "victim", epoch: int = 1) -> KvpoolError:
            return _refused(lambda: target.import_state(session_id, epoch, data, chunk_bytes=CHUNK))

        flipped = bytearray(state)
        flipped[len(state) // 2] ^= 0x40
        assert "(checksum)" in str(refused(bytes(flipped)))
        assert refused(bytes(flipped)).code == "bad_request"
        assert "(truncated)" in str(refused(state[:-7]))
        assert "(magic)" in str(refused(b"\0" * 100))
        # chunks out of order, and a total that changes, drop the partial import
        calls = list(import_calls("victim", 1, state, CHUNK))
        target._call(calls[0])
        assert _refused(lambda: target._call(calls[2])).code == "bad_request"
        assert "offset 0" in str(_refused(lambda: target._call(calls[1])))  # the import was dropped
        target._call(calls[0])
        changed = calls[1].request
        grown = Import(session_id="victim", epoch=1, state=changed.state, offset=changed.offset, total_bytes=changed.total_bytes + 1)
        assert "total_bytes changed" in str(_refused(lambda: target._call(Call(grown, Done))))
        # the import cap, at its edge: a total of the cap is taken (then refused for what it holds), one more is not
        at_cap = refused(b"K" * IMPORT_CAP)
        assert "(magic)" in str(at_cap)
        over_cap = refused(b"K" * (IMPORT_CAP + 1))
        assert over_cap.code == "bad_request" and "import cap" in str(over_cap)
        # a session of n_ctx beyond this daemon's --n-ctx
        source.append("wide", 1, 0, tokens=prompt)  # n_ctx: the exporter's default, WIDE_N_CTX
        wide = refused(source.export_state("wide", 1), "wide")
        assert wide.code == "bad_request" and "--n-ctx" in str(wide)
        # fencing: an epoch below the one seen is stale; a live id must be released first
        target.append("fenced", 2, 0, tokens=prompt[:3])
        assert refused(state, "fenced", 1).code == "stale_epoch"
        assert refused(state, "bystander", 1).code == "bad_request"
        sessions_after = _sessions(target)
        assert sessions_after.pop("fenced") == (2, 3, "hot")
        assert sessions_after == sessions_before  # no session added, none touched
        assert sorted(target_daemon.worker_pids()) == workers_before and _checked(target).counters.get("worker_restarts", 0) == 0
        # the bystander's state still continues exactly
        source.append("victim", 1, len(prompt), tokens=[9])
        assert np.array_equal(target.append("bystander", 1, len(prompt) + 1, tokens=[11]).rows, source.append("victim", 1, len(prompt) + 1, tokens=[11]).rows)
        for session_id, epoch in (("victim", 1), ("wide", 1)):
            source.release(session_id, epoch)
        for session_id, epoch in (("bystander", 1), ("fenced", 2)):
            target.release(session_id, epoch)
        assert _checked(target).counters["bad_requests"] >= 9


def test_a_state_llama_cpp_refuses_behind_a_valid_header_is_restore_failed_and_touches_nothing_else(process_pair, prompt_ids):
    """An importer can seal anything with a daemon's identity (its Hello names it): the header and checksum
    hold, so the import is admitted, but llama.cpp refuses the payload at the restore (another shard's
    layer count, or bytes cut short): the append is cache_miss restore_failed, that context is freed, no row
    comes back, and a bystander session on the same daemon continues exactly."""
    source_daemon, target_daemon = process_pair
    with source_daemon.client() as source, target_daemon.client() as target:
        prompt = prompt_ids[0][:10]
        target.append("bystander", 1, 0, tokens=prompt, n_ctx=N_CTX)
        source.append("good", 1, 0, tokens=prompt, n_ctx=N_CTX)
        header, payload = open_state(source.export_state("good", 1), source.hello.state_identity)
        identity = target.hello.state_identity
        assert identity == source.hello.state_identity  # the same shard file: one identity
        damaged = {"cut": payload[: len(payload) // 2], "noise": bytes(len(payload))}
        for name, bad in damaged.items():
            forged = seal(msgspec.structs.replace(header, session_id=name, payload_bytes=len(bad)), bad)
            assert target.import_state(name, 1, forged) == len(prompt)
            refused = _refused(lambda: target.append(name, 1, len(prompt), tokens=[42]))
            assert (refused.code, refused.reply.reason) == ("cache_miss", "restore_failed"), refused
            assert name not in _sessions(target)
        continued = target.append("bystander", 1, len(prompt), tokens=[42])
        alone = source.append("good", 1, len(prompt), tokens=[42])
        assert np.array_equal(continued.rows, alone.rows)
        assert _sessions(target) == {"bystander": (1, len(prompt) + 1, "hot")}
        source.release("good", 1)
        target.release("bystander", 1)


def _forged_cells(payload: bytes) -> dict[str, bytes]:
    """The state with its cells' positions no longer [0, n) once each, its K/V bytes untouched."""
    state = parse_state(payload)
    (stream,) = [stream for stream in state.streams if stream.n_cells]

    def with_positions(change) -> bytes:
        positions = stream.positions.copy()
        change(positions)
        streams = tuple(dataclasses.replace(each, positions=positions) if each is stream else each for each in state.streams)
        return write_state(dataclasses.replace(state, streams=streams))

    return {
        "shifted": with_positions(lambda positions: positions.__iadd__(1)),
        "negative": with_positions(lambda positions: positions.__setitem__(0, -1)),
        "duplicated": with_positions(lambda positions: positions.__setitem__(1, positions[0])),
    }


def _forged_cells_are_refused_before_any_compute(source, target, prompt):
    """Issue 26 item 5: a state sealed with the daemon's identity whose cells hold shifted, negative or duplicated
    positions is imported (its header and checksum hold) but never restored: the append is cache_miss
    restore_failed, no row comes back, and a bystander continues exactly. Process mode used to restore such
    states and compute on them (max |delta| 2.41); batched mode refused them: both now check the same rule
    (kvpool.state.sequence.check_cells, in Books.take_blob) before a worker sees the bytes."""
    target.append("bystander", 1, 0, tokens=prompt, n_ctx=N_CTX)
    source.append("good", 1, 0, tokens=prompt, n_ctx=N_CTX)
    header, payload = open_state(source.export_state("good", 1), source.hello.state_identity)
    failures = _checked(target).counters.get("restore_failures", 0)
    forged = _forged_cells(payload)
    for name, bad in forged.items():
        assert target.import_state(name, 1, seal(msgspec.structs.replace(header, session_id=name, payload_bytes=len(bad)), bad)) == len(prompt)
        refused = _refused(lambda: target.append(name, 1, len(prompt), tokens=[42]))
        assert (refused.code, refused.reply.reason) == ("cache_miss", "restore_failed"), (name, refused)
        assert "cells" in str(refused), refused
    stats = _checked(target)
    assert stats.counters["restore_failures"] == failures + len(forged)
    assert np.array_equal(target.append("bystander", 1, len(prompt), tokens=[42]).rows, source.append("good", 1, len(prompt), tokens=[42]).rows)
    sessions = _sessions(target)
    assert sessions["bystander"] == (1, len(prompt) + 1, "hot") and not set(forged) & set(sessions)
    source.release("good", 1)
    target.release("bystander", 1)


def test_a_state_whose_cells_do_not_hold_positions_0_to_length_is_never_restored(process_pair, prompt_ids):
    source_daemon, target_daemon = process_pair
    with source_daemon.client() as source, target_daemon.client() as target:
        _forged_cells_are_refused_before_any_compute(source, target, prompt_ids[0][:10])


def test_another_shards_state_is_refused_identity_mismatch(process_pair, shards, socket_dir, prompt_ids):
    source_daemon, _target = process_pair
    middle = _serve(shards[1].path, socket_dir, "middle", "--n-ctx", str(N_CTX))
    try:
        with source_daemon.client() as source, middle.client() as client:
            source.append("first", 1, 0, tokens=prompt_ids[0][:6], n_ctx=N_CTX)
            state = source.export_state("first", 1)
            refused = _refused(lambda: client.import_state("first", 1, state))
            assert (refused.code, refused.reason) == ("cache_miss", "identity_mismatch")
            assert "layer_start" in str(refused)
            stats = _checked(client)
            assert stats.sessions == [] and stats.counters["misses_identity_mismatch"] == 1
            source.release("first", 1)
    finally:
        middle.stop()


def test_an_export_is_one_state_and_refuses_unknown_sessions_and_stale_chunks(process_pair, prompt_ids):
    source_daemon, target_daemon = process_pair
    with source_daemon.client() as source:
        assert _refused(lambda: source.export_state("nobody", 1)).code == "cache_miss"
        source.append("chunked", 1, 0, tokens=prompt_ids[1][:8], n_ctx=N_CTX)
        first = source._call(_chunk(offset=0))
        assert _refused(lambda: source._call(_chunk(offset=CHUNK, export_id=first.export_id + 1))).code == "bad_request"
        assert _refused(lambda: source._call(_chunk(offset=first.total_bytes, export_id=first.export_id))).code == "bad_request"
        source.append("chunked", 1, 8, tokens=[4])  # the session moves on between the chunks of one export
        chunks = [first]
        while (offset := sum(len(chunk.state) for chunk in chunks)) < first.total_bytes:
            chunks.append(source._call(_chunk(offset=offset, export_id=first.export_id)))
        assert all(len(chunk.state) <= CHUNK for chunk in chunks) and {chunk.total_bytes for chunk in chunks} == {first.total_bytes}
        state = b"".join(chunk.state for chunk in chunks)
        assert read_header(state).length == first.length == 8  # every chunk is of the state offset 0 saved
        with target_daemon.client() as target:
            assert target.import_state("chunked", 1, state) == 8  # and its checksum holds
            expected = target.append("chunked", 1, 8, tokens=[4]).rows
            target.release("chunked", 1)
        source.truncate("chunked", 1, 8)
        assert np.array_equal(source.append("chunked", 1, 8, tokens=[4]).rows, expected)
        source.release("chunked", 1)  # its kept export ends with it
        assert _refused(lambda: source._call(_chunk(offset=CHUNK, export_id=first.export_id))).code == "cache_miss"


def test_two_callers_export_one_session_at_once_and_each_gets_a_whole_state(process_pair, prompt_ids):
    """Issue 26 item 6, on a daemon: a second caller's offset-0 export of a session does not invalidate the first
    caller's export in the middle of its transfer: their chunks interleave and both states import and continue."""
    source_daemon, target_daemon = process_pair
    with source_daemon.client() as source, source_daemon.client() as other:
        source.append("chunked", 1, 0, tokens=prompt_ids[1][:8], n_ctx=N_CTX)
        first = [source._call(_chunk(offset=0))]
        assert first[0].total_bytes > CHUNK  # several chunks: the second export starts in the middle of the first
        second = [other._call(_chunk(offset=0))]
        assert second[0].export_id != first[0].export_id
        states = []
        for client, chunks in ((source, first), (other, second)):
            while (offset := sum(len(chunk.state) for chunk in chunks)) < chunks[0].total_bytes:
                chunks.append(client._call(_chunk(offset=offset, export_id=chunks[0].export_id)))
            states.append(b"".join(chunk.state for chunk in chunks))
        with target_daemon.client() as target:
            continued = []
            for state in states:
                assert target.import_state("chunked", 1, state) == 8
                continued.append(target.append("chunked", 1, 8, tokens=[4]).rows)
                target.release("chunked", 1)
            _checked(target)
        expected = source.append("chunked", 1, 8, tokens=[4]).rows
        assert all(np.array_equal(rows, expected) for rows in continued)
        source.release("chunked", 1)
        _checked(source)


def _chunk(*, offset: int, export_id: int = 0) -> Call[Exported]:
    return Call(Export(session_id="chunked", epoch=1, offset=offset, export_id=export_id), Exported)


# ---- batched mode on both daemons --------------------------------------------------------------------


def test_a_batched_session_moves_between_batched_daemons(shards, socket_dir, prompt_ids):
    batched = ("--mode", "batched", "--seqs-per-worker", "2", "--n-ctx", str(N_CTX))
    source_daemon = _serve(shards[0].path, socket_dir, "batched-a", *batched)
    target_daemon = _serve(shards[0].path, socket_dir, "batched-b", *batched)
    try:
        with source_daemon.client() as source, target_daemon.client() as target:
            source.append("neighbour", 1, 0, tokens=prompt_ids[1][:5])  # the other sequence of the context
            _round_trip(source, target, prompt_ids[0][:15])
            assert _sessions(source)["neighbour"] == (1, 5, "hot")
            _forged_cells_are_refused_before_any_compute(source, target, prompt_ids[1][:10])  # the same rule in batched mode
    finally:
        source_daemon.stop()
        target_daemon.stop()


def test_the_transfer_limits_are_validated_at_their_edges(tmp_path):
    def config(**fields):
        return ServeConfig(model=tmp_path / "m.gguf", socket=tmp_path / "s.sock", **fields)

    assert config(export_chunk_bytes=MIN_EXPORT_CHUNK_BYTES, max_import_bytes=1).export_chunk_bytes == 1024
    with pytest.raises(ValueError, match="--export-chunk-bytes must be at least 1024"):
        config(export_chunk_bytes=MIN_EXPORT_CHUNK_BYTES - 1)
    with pytest.raises(ValueError, match="--max-import-bytes"):
        config(max_import_bytes=0)
    assert import_chunk_bytes(1024) == 512 and import_chunk_bytes(64 * 1024**2) == 1024**2


# ---- the books of transfers, fake bytes --------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_import_buffers_take_chunks_in_order_within_the_cap():
    buffers = ImportBuffers(10)
    assert not buffers.add("a", 1, 0, 10, b"01234").complete
    with pytest.raises(TransferRefused, match="in order"):
        buffers.add("a", 1, 6, 10, b"6")
    assert len(buffers) == 0  # dropped
    with pytest.raises(TransferRefused, match="offset 0"):
        buffers.add("a", 1, 5, 10, b"56789")
    buffers.add("a", 1, 0, 10, b"01234")
    with pytest.raises(TransferRefused, match="total_bytes changed"):
        buffers.add("a", 1, 5, 9, b"5678")
    buffers.add("a", 1, 0, 10, b"01234")
    with pytest.raises(TransferRefused, match="offset 0"):
        buffers.add("a", 2, 5, 10, b"56789")  # another epoch's chunk
    buffers.add("a", 1, 0, 10, b"01234")
    with pytest.raises(TransferRefused, match="does not fit"):
        buffers.add("a", 1, 5, 10, b"567890")
    assert buffers.add("b", 1, 0, 10, b"0123456789").complete  # at the cap
    assert buffers.take("b") == b"0123456789" and len(buffers) == 0
    with pytest.raises(TransferRefused, match="import cap"):
        buffers.add("b", 1, 0, 11, b"0")
    with pytest.raises(TransferRefused, match="import cap"):
        buffers.add("b", 1, 0, 0, b"")


def test_import_buffers_hold_the_cap_in_all_and_drop_idle_imports():
    clock = Clock()
    buffers = ImportBuffers(10, keep_s=5.0, clock=clock)
    buffers.add("a", 1, 0, 6, b"0")
    buffers.add("b", 1, 0, 4, b"0")
    assert buffers.reserved_bytes == 10
    buffers.add("c", 1, 0, 3, b"0")  # the oldest gives way
    assert buffers.reserved_bytes == 7 and len(buffers) == 2
    with pytest.raises(TransferRefused):
        buffers.add("a", 1, 1, 6, b"1")
    clock.now = 6.0
    with pytest.raises(TransferRefused):
        buffers.add("b", 1, 1, 4, b"1")  # idle past keep_s: gone
    assert len(buffers) == 0


def test_the_export_cache_serves_one_state_per_export():
    clock = Clock()
    cache = ExportCache(kept=2, keep_s=5.0, clock=clock)
    first = cache.keep("a", 1, b"abcdef", 3)
    assert cache.find("a", 1, first.export_id).chunk(4, 4) == b"ef"
    with pytest.raises(TransferRefused):
        cache.find("a", 2, first.export_id)
    with pytest.raises(TransferRefused):
        cache.find("b", 1, first.export_id)
    with pytest.raises(TransferRefused):
        first.chunk(6, 1)
    clock.now = 6.0
    with pytest.raises(TransferRefused):
        cache.find("a", 1, first.export_id)  # idle past keep_s: gone
    assert len(cache) == 0


def test_a_second_export_of_a_session_leaves_the_first_standing_until_it_is_finished_or_idle():
    """Issue 26 item 6: an offset-0 export by a second caller used to replace the first caller's export in
    the middle of its transfer. Each export stands until its last chunk was handed out or it sat idle; past
    `kept` a finished export gives way, an unfinished one never does (the new export waits: ExportsFull)."""
    clock = Clock()
    cache = ExportCache(kept=2, keep_s=5.0, clock=clock)
    first = cache.keep("a", 1, b"abcdef", 3)
    second = cache.keep("a", 1, b"ABCDEF", 3)  # another caller, same session
    assert first.export_id != second.export_id
    assert cache.find("a", 1, first.export_id).chunk(0, 4) == b"abcd"
    assert cache.find("a", 1, second.export_id).chunk(0, 4) == b"ABCD"
    with pytest.raises(ExportsFull) as full:
        cache.keep("b", 1, b"b", 1)  # both still being read: nothing is cut short for a third
    assert 0 < full.value.retry_after_s <= 5.0
    assert cache.find("a", 1, first.export_id).chunk(4, 4) == b"ef"  # the first one finishes
    third = cache.keep("b", 1, b"b", 1)  # the finished export gives way
    with pytest.raises(TransferRefused):
        cache.find("a", 1, first.export_id)
    assert cache.find("a", 1, second.export_id).chunk(4, 4) == b"EF"
    assert cache.find("b", 1, third.export_id).chunk(0, 4) == b"b"
    cache.drop("a")  # the session ended: its exports with it
    assert len(cache) == 1 and cache.held_bytes == 1

"""The warm and disk tiers, export and import, and what each stop keeps, on fake workers in both modes: the
books' side of the durability contract (README, "Sessions that outlive the daemon"). A fake daemon cannot be
SIGKILLed; its immediate stop keeps what was on disk and loses what was in memory, as a crash does."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from kvpool.state.header import open_state, seal
from kvpool.state.sequence import parse_state, write_state
from tests.support.contract import MODES, mode_flags, rows_of, tokens
from tests.support.daemons import refused, wait_until
from tests.support.fake_worker import expected_rows


def _disk(spill_dir, *more: str) -> tuple[str, ...]:
    return ("--spill-dir", str(spill_dir), "--spill-disk-budget", "16MiB", *more)


@pytest.mark.parametrize("mode", MODES)
def test_a_drained_daemons_sessions_are_adopted_by_its_successor_and_continue_exactly(serve, fake_model, tmp_path, mode):
    spill_dir = tmp_path / "spill"
    daemon = serve(fake_model, *mode_flags(mode), *_disk(spill_dir))
    with daemon.client() as client:
        client.append("hot", 1, 0, tokens=[1, 2, 3])
        client.append("parked", 2, 0, tokens=[4, 5])
        client.park("parked", 2)
    assert daemon.drain() == 0
    assert "drain done: parked 2 sessions on disk" in daemon.log()
    successor = serve(fake_model, *mode_flags(mode), *_disk(spill_dir), name="successor")
    assert "adopted 2 parked sessions" in successor.log()
    with successor.client() as client:
        assert {(row.session_id, row.epoch, row.length, row.tier) for row in client.stats().sessions} == {("hot", 1, 3, "disk"), ("parked", 2, 2, "disk")}
        restored = client.append("hot", 1, 3, tokens=[9])
        assert restored.restored and np.array_equal(restored.rows, rows_of(client, [1, 2, 3, 9]))
        assert refused(lambda: client.append("parked", 1, 0, tokens=[1])).code == "stale_epoch"  # the adopted epoch fences
        assert np.array_equal(client.append("parked", 2, 2, tokens=[6]).rows, rows_of(client, [4, 5, 6]))


@pytest.mark.parametrize("mode", MODES)
def test_a_copy_written_behind_never_claims_positions_a_truncate_took_back(serve, fake_model, tmp_path, mode):
    """Issue 26 item 1 on the books: copied behind (--persist-after), parked, truncated to 2 while parked, grown
    past the copy's length with other tokens, then the daemon stops at once (what is on disk stays, as after a
    crash). The successor must not adopt the old history: nothing, or a copy of the history now."""
    spill_dir = tmp_path / "spill"
    options = (*mode_flags(mode), *_disk(spill_dir, "--persist-after", "0.05"))
    daemon = serve(fake_model, *options)
    with daemon.client() as client:
        client.append("s", 1, 0, tokens=[1, 2, 3, 4, 5, 6])
        wait_until(lambda: client.stats().counters.get("persisted", 0) >= 1, "the copy written behind")
        client.park("s", 1)
        assert client.truncate("s", 1, 2) == 2
        client.append("s", 1, 2, tokens=[7, 8, 9, 10])
        client.append("s", 1, 6, tokens=[11])  # past the old copy's length, at once: no newer copy has been written
    daemon.stop()
    successor = serve(fake_model, *options, name="successor")
    with successor.client() as client:
        rows = {row.session_id: row.length for row in client.stats().sessions}
        if "s" not in rows:
            assert refused(lambda: client.append("s", 1, 7, tokens=[12])).code == "cache_miss"
        else:
            held = rows["s"]
            history = [1, 2, 7, 8, 9, 10, 11][:held]
            reply = client.append("s", 1, held, tokens=[12])
            assert np.array_equal(reply.rows, rows_of(client, history + [12])), "the old history's KV came back"


@pytest.mark.parametrize("mode", MODES)
def test_an_export_imports_into_a_daemon_of_the_same_shard_and_continues_exactly(serve, fake_model, mode):
    source, target = serve(fake_model, *mode_flags(mode), name="source"), serve(fake_model, *mode_flags(mode), name="target")
    with source.client() as a, target.client() as b:
        a.append("s", 1, 0, tokens=[1, 2, 3])
        assert b.import_state("s", 1, a.export_state("s", 1)) == 3
        assert [row.tier for row in a.stats().sessions] == ["hot"]  # an export leaves the session hot
        moved = b.append("s", 1, 3, tokens=[4])
        assert moved.restored and np.array_equal(moved.rows, a.append("s", 1, 3, tokens=[4]).rows)
        assert refused(lambda: b.import_state("s", 1, a.export_state("s", 1))).code == "bad_request"  # it holds state
        assert refused(lambda: b.import_state("t", 1, b"not a state")).code == "bad_request"


@pytest.mark.parametrize("mode", MODES)
def test_a_state_whose_cells_are_not_positions_0_to_n_once_each_is_never_restored(serve, fake_model, mode):
    """Issue 26 item 5 on the books: one rule for both modes, before a worker sees the bytes."""
    daemon = serve(fake_model, *mode_flags(mode))
    with daemon.client() as client:
        client.append("good", 1, 0, tokens=[1, 2, 3, 4])
        header, payload = open_state(client.export_state("good", 1), client.hello.state_identity)
        state = parse_state(payload)
        (stream,) = state.streams
        for name, positions in {"shifted": stream.positions + 1, "negative": np.array([-1, 1, 2, 3], np.int32),
                                "duplicated": np.array([0, 0, 2, 3], np.int32)}.items():
            forged = write_state(dataclasses.replace(state, streams=(dataclasses.replace(stream, positions=positions.astype(np.int32)),)))
            assert client.import_state(name, 1, seal(msgspec.structs.replace(header, session_id=name, payload_bytes=len(forged)), forged)) == 4
            error = refused(lambda: client.append(name, 1, 4, tokens=[5]))
            assert (error.code, error.reason) == ("cache_miss", "restore_failed") and "cells" in str(error)
        assert [row.session_id for row in client.stats().sessions] == ["good"]


def test_two_exports_of_one_session_stand_side_by_side(serve, fake_model):
    """Issue 26 item 6 on the books: a second caller's export does not cut the first short."""
    from kvpool.client.messages import Call
    from kvpool.wire.protocol import Export, Exported

    daemon = serve(fake_model, "--export-chunk-bytes", "1KiB")
    with daemon.client() as one, daemon.client() as two:
        one.append("s", 1, 0, tokens=list(range(40)))

        def chunk(client, offset: int, export_id: int = 0) -> Exported:
            return client._call(Call(Export(session_id="s", epoch=1, offset=offset, export_id=export_id), Exported))

        firsts = [chunk(one, 0), chunk(two, 0)]
        assert firsts[0].total_bytes > 1024 and firsts[0].export_id != firsts[1].export_id
        states = []
        for client, first in zip((one, two), firsts):
            parts = [first]
            while (offset := sum(len(part.state) for part in parts)) < first.total_bytes:
                parts.append(chunk(client, offset, first.export_id))
            states.append(b"".join(part.state for part in parts))
        identity = one.hello.state_identity
        assert open_state(states[0], identity)[1] == open_state(states[1], identity)[1]  # each a whole state of the session (saved apart)


@pytest.mark.parametrize("mode", MODES)
def test_an_immediate_stop_keeps_what_is_on_disk_and_loses_what_was_in_memory(serve, fake_model, tmp_path, mode):
    spill_dir = tmp_path / "spill"
    daemon = serve(fake_model, *mode_flags(mode), *_disk(spill_dir), "--spill-budget", "1")  # a parked state goes to disk at once
    with daemon.client() as client:
        client.append("on-disk", 1, 0, tokens=[1, 2])
        client.park("on-disk", 1)
        client.append("hot", 1, 0, tokens=[3])
    daemon.stop()
    successor = serve(fake_model, *mode_flags(mode), *_disk(spill_dir), name="successor")
    with successor.client() as client:
        assert [(row.session_id, row.length) for row in client.stats().sessions] == [("on-disk", 2)]
        assert np.array_equal(client.append("on-disk", 1, 2, tokens=[4]).rows, expected_rows(client.hello.shard.shape, tokens(1, 2, 4)))
        assert (refused(lambda: client.append("hot", 1, 1, tokens=[4])).code) == "cache_miss"

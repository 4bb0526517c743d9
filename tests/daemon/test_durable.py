"""Saved states that outlive the daemon (issue 20, items 1 and 2): the header every stored state carries
(kvpool.state.header: identity, owner, times, CRC-32C), a restore refused before llama.cpp when it is another
daemon's, and adoption on start of the --spill-dir files a crash or a drain left: the highest epoch per id,
never a foreign, older, truncated, corrupt or linked file, and the continuation bit-identical."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import numpy as np
import psutil
import pytest

from kvpool.client.client import KvpoolError
from kvpool.daemon.books import spill
from kvpool.daemon.books.books import Books
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.books.spill import CorruptBlob, SpillStore
from kvpool.state import header as state_header
from kvpool.state.header import FORMAT_VERSION, StateHeader, StateIdentity, StateRejected, open_state, read_header, seal
from tests.support.chains import daemon_chain, greedy_with_logits
from tests.support.daemons import STOP_HANG_GUARD_S, DaemonProcess, wait_until

N_CTX = 64
IDENTITY = StateIdentity("ab" * 32, 10, 20, 0, "cd" * 32, "llama-cpp-python 0.3.36", 1, 1, False, 7680)


def _header(payload: bytes, **fields) -> StateHeader:
    values = dict(version=FORMAT_VERSION, identity=IDENTITY, session_id="s", epoch=3, length=5, n_ctx=64,
                  saved_at=time.time(), last_used=time.time() - 10, payload_bytes=len(payload))
    values.update(fields)
    return StateHeader(**values)


# ---- the header (pure) ---------------------------------------------------------------------------------


def test_a_sealed_state_opens_with_its_identity_and_gives_back_its_payload_and_owner():
    payload = bytes(range(256)) * 3
    data = seal(_header(payload), payload)
    assert data.startswith(state_header.MAGIC)
    header, opened = open_state(data, IDENTITY)
    assert opened == payload and (header.session_id, header.epoch, header.length, header.n_ctx) == ("s", 3, 5, 64)
    assert read_header(data) == header


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:-1], "truncated"),
    (lambda data: data[:11], "truncated"),
    (lambda data: data + b"x", "truncated"),
    (lambda data: b"KVPSPIL1" + data[8:], "magic"),
    (lambda data: data[:-20] + bytes([data[-20] ^ 0x01]) + data[-19:], "checksum"),  # one bit of the payload
    (lambda data: data[:-1] + bytes([data[-1] ^ 0x80]), "checksum"),  # one bit of the CRC itself
])
def test_every_damage_is_refused_with_its_reason(damage, reason):
    payload = b"\x07" * 100
    with pytest.raises(StateRejected) as refused:
        open_state(damage(seal(_header(payload), payload)), IDENTITY)
    assert refused.value.reason == reason


def test_another_identity_or_format_version_is_refused_before_the_payload_is_used():
    payload = b"\x07" * 100
    for field, value in (("layer_stop", 21), ("shard_sha256", "ee" * 32), ("flash_attn", True), ("llama_build", "llama-cpp-python 0.3.37"),
                         ("kv_bytes_per_position", 7681), ("type_v", 8), ("seqs_per_context", 4)):
        other = msgspec.structs.replace(IDENTITY, **{field: value})
        with pytest.raises(StateRejected, match=field) as refused:
            open_state(seal(_header(payload, identity=other), payload), IDENTITY)
        assert refused.value.reason == "identity"
    with pytest.raises(StateRejected) as refused:
        open_state(seal(_header(payload, version=FORMAT_VERSION + 1), payload), IDENTITY)
    assert refused.value.reason == "version"
    with pytest.raises(ValueError):
        seal(_header(payload, payload_bytes=99), payload)


def test_random_bytes_and_every_truncation_are_refused_never_a_crash():
    payload = b"\x01\x02" * 40
    data = seal(_header(payload), payload)
    rng = np.random.default_rng(7)
    for cut in range(len(data)):
        with pytest.raises(StateRejected):
            open_state(data[:cut], IDENTITY)
    for _ in range(300):
        flipped = bytearray(data)
        flipped[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        with pytest.raises(StateRejected):
            open_state(bytes(flipped), IDENTITY)


# ---- daemons -----------------------------------------------------------------------------------------


def _serve(shard, socket_path, spill_dir, *options: str) -> DaemonProcess:
    # a memory tier of 1 byte: every parked state goes to disk at once
    return DaemonProcess(shard.path, socket_path, "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "2",
                         "--spill-budget", "1", "--spill-dir", str(spill_dir), "--spill-disk-budget", "64MiB", *options)


def _rows(shard, count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, shard.shape.n_embd)).astype(np.float32)


def _files(spill_dir) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(spill_dir.iterdir()) if spill.OWN_FILE.fullmatch(path.name)}


def _killed(daemon: DaemonProcess) -> None:
    """SIGKILL of the supervisor: its workers follow (they watch their parent), its files stay."""
    workers = daemon.worker_pids()
    os.kill(daemon.process.pid, signal.SIGKILL)
    daemon.process.wait(STOP_HANG_GUARD_S)
    wait_until(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in workers),
               "the killed supervisor's workers exit")
    daemon.socket.unlink()  # a killed daemon cannot remove its socket file
    daemon.stop()  # nothing left to stop: its log and lifeline are closed


def _reseal(data: bytes, **changes) -> bytes:
    """The same payload under a changed header: what another daemon, or another epoch, would have written."""
    header = read_header(data)
    _, payload = open_state(data, header.identity)
    identity = msgspec.structs.replace(header.identity, **changes.pop("identity", {}))
    return seal(msgspec.structs.replace(header, identity=identity, **changes), payload)


def test_the_books_refuse_a_stored_state_of_another_identity_as_a_mismatch():
    """What identity_mismatch is: a stored state sealed under one identity does not open under another (a
    daemon of another shard, build or layout), before any worker sees its bytes."""
    books = Books(1 << 20, ["w"], spill=SpillStore(1 << 20), identity=IDENTITY)
    session = Session("s", 1, N_CTX, 1000, "", length=4, last_used=time.monotonic())
    books.add_parked(session, b"llama state bytes")
    assert books.read_blob(session) == b"llama state bytes"
    books.sealing.identity = msgspec.structs.replace(IDENTITY, layer_stop=21)
    with pytest.raises(CorruptBlob, match="layer_stop") as refused:
        books.take_blob(session)
    assert refused.value.mismatch


def test_a_file_replaced_while_its_session_is_parked_is_a_cache_miss_and_never_reaches_llama_cpp(shards, socket_dir, tmp_path):
    """The store keeps each file's checksum from when it wrote (or adopted) it: a file replaced behind its
    back, even by a well-formed state of another identity, is restore_failed for that session alone."""
    shard = shards[1]
    spill_dir = tmp_path / "spill"
    daemon = _serve(shard, socket_dir / "mismatch.sock", spill_dir)
    try:
        with daemon.client(direct=False) as client:
            client.append("a", 1, 0, hidden=_rows(shard, 6, 1))
            client.append("b", 1, 0, hidden=_rows(shard, 4, 3))
            client.park("a", 1)
            (name, data), = _files(spill_dir).items()
            assert read_header(data).identity.layer_start == 10 and read_header(data).length == 6
            (spill_dir / name).write_bytes(_reseal(data, identity={"layer_stop": 21}))
            with pytest.raises(KvpoolError) as missed:
                client.append("a", 1, 6, hidden=_rows(shard, 1, 2))
            assert (missed.value.code, missed.value.reason) == ("cache_miss", "restore_failed")
            assert client.append("b", 1, 4, hidden=_rows(shard, 1, 4)).length == 5  # the other session untouched
            stats = client.stats()
            assert stats.integrity == "ok" and [row.session_id for row in stats.sessions] == ["b"]
            assert _files(spill_dir) == {}
    finally:
        daemon.stop()


def test_a_daemon_adopts_its_own_files_a_crash_left_and_refuses_every_other(shards, socket_dir, tmp_path):
    """Daemon A parks three sessions to disk (one at two epochs: the fence releases the lower), a file of the
    first shard's daemon and damaged copies are planted beside them, A is SIGKILLed; daemon B on the same
    spill dir adopts exactly A's live sessions (epoch, length, idle time), counts the rest by reason in
    one log line, removes them, and each adopted session continues bit-identically."""
    middle, first = shards[1], shards[0]
    spill_dir = tmp_path / "spill"
    old = _serve(middle, socket_dir / "a.sock", spill_dir)
    other = _serve(first, socket_dir / "other.sock", tmp_path / "other-spill")
    prefix = {"s1": _rows(middle, 7, 11), "s2": _rows(middle, 5, 12)}
    try:
        with old.client(direct=False) as client:
            for session, rows in prefix.items():
                client.append(session, 2, 0, hidden=rows)
                client.park(session, 2)
            client.append("lower", 1, 0, hidden=_rows(middle, 3, 13))
            client.park("lower", 1)
            kept = _files(spill_dir)
            assert len(kept) == 3
        with other.client(direct=False) as client:
            client.append("foreign", 1, 0, tokens=[1, 2, 3])
            client.park("foreign", 1)
        (foreign,) = _files(tmp_path / "other-spill").values()
        time.sleep(1.0)  # an idle time to keep
        _killed(old)
        sample = next(data for data in kept.values() if read_header(data).session_id == "s1")
        planted = {
            "kvpool-00000090.kvstate": foreign,
            "kvpool-00000091.kvstate": sample[: len(sample) // 2],
            "kvpool-00000092.kvstate": sample[:-30] + bytes([sample[-30] ^ 0x10]) + sample[-29:],
            "kvpool-00000093.kvstate": b"KVPSPIL1" + sample,
            "kvpool-00000094.kvstate": _reseal(sample, epoch=1),  # s1 at a lower epoch beside epoch 2
        }
        for name, data in planted.items():
            (spill_dir / name).write_bytes(data)
        (spill_dir / "kvpool-00000095.kvstate").symlink_to(spill_dir / next(iter(kept)))

        new = _serve(middle, socket_dir / "b.sock", spill_dir)
        try:
            assert "adopted 3 parked sessions" in new.log()
            line = next(line for line in new.log().splitlines() if "adopted 3 parked sessions" in line)
            for reason in ("1 another shard, build or KV layout", "1 truncated", "1 corrupt", "1 an older format",
                           "1 an older epoch of its session", "1 a link or not a regular file"):
                assert reason in line, line
            assert sorted(_files(spill_dir)) == sorted(kept)  # every planted file removed, the link's target kept
            with new.client(direct=False) as client:
                stats = client.stats()
                rows = {row.session_id: row for row in stats.sessions}
                assert {(s, r.epoch, r.length, r.tier) for s, r in rows.items()} == {("s1", 2, 7, "disk"), ("s2", 2, 5, "disk"), ("lower", 1, 3, "disk")}
                assert all(row.idle_s >= 1.0 for row in rows.values()) and stats.integrity == "ok" and stats.counters["adopted"] == 3
                with pytest.raises(KvpoolError, match="stale_epoch"):
                    client.append("s1", 1, 0, hidden=_rows(middle, 1, 1))  # the adopted epoch fences the lower one
                for session, rows_before in prefix.items():
                    step = _rows(middle, 1, 99)
                    continued = client.append(session, 2, len(rows_before), hidden=step)
                    assert continued.restored
                    client.append(f"ref-{session}", 1, 0, hidden=rows_before)  # the same partition, never stopped
                    reference = client.append(f"ref-{session}", 1, len(rows_before), hidden=step)
                    assert np.array_equal(continued.rows, reference.rows)
                    client.release(f"ref-{session}", 1)
                assert client.stats().integrity == "ok"
        finally:
            new.stop()
    finally:
        other.stop()
        old.stop()


@pytest.mark.parametrize("mode", ["process", "batched"])
def test_after_a_crash_only_the_tail_is_replayed_from_the_copy_written_behind(shards, socket_dir, tmp_path, local_chain, prompt_ids, mode):
    """--persist-after: each daemon writes a copy of an idle hot session behind to its disk tier. The middle
    daemon's supervisor is SIGKILLed mid-generation and a new daemon starts on its socket and spill dir: it
    adopts the copy at the length it was written; the router's next append meets the lost connection, finds
    that length by truncating, replays only the tokens since (same epoch) and the generation goes on bit for
    bit as an uninterrupted run's (kvpool.local.chain.LocalChain, same partition). In both modes."""
    from kvpool.router.router import Router

    n_ctx, chunk, greedy = 512, 7, 12
    prompt = prompt_ids[1]
    options = ("--threads", "1", "--n-ctx", str(n_ctx), "--max-sessions", "2", "--mode", mode, "--seqs-per-worker", "2", "--spill-disk-budget", "64MiB",
               "--persist-after", "2")  # far above a decode step on a slow, busy machine: no copy after the wait
    spill_dirs = [("--spill-dir", str(tmp_path / f"spill{index}")) for index in range(3)]

    with local_chain.new_session(n_ctx) as alone:
        expected = greedy_with_logits(alone.append, prompt, greedy, prefill_chunk=chunk)
    with daemon_chain([shard.path for shard in shards], socket_dir, f"persist-{mode}", *options, per_daemon=spill_dirs) as daemons:
        clients = [daemon.client() for daemon in daemons]
        adopted_length = []
        try:
            session = Router(clients).session("tail")
            steps = len(range(0, len(prompt), chunk))

            def crash_the_middle_daemon(step):
                if step == steps + 2:
                    wait_until(lambda: clients[1].stats().counters.get("persisted", 0) >= 1, "a copy written behind")
                if step == steps + 5:
                    _killed(daemons[1])
                    daemons[1] = DaemonProcess(shards[1].path, daemons[1].socket, *options, *spill_dirs[1])
                    with daemons[1].client() as fresh:
                        (row,) = fresh.stats().sessions
                        adopted_length.append(row.length)

            got = greedy_with_logits(session.append_at, prompt, greedy, prefill_chunk=chunk, before_step=crash_the_middle_daemon)
            assert got[0] == expected[0] and np.array_equal(got[1], expected[1])
            counts = session.counts
            (length,) = adopted_length
            assert len(prompt) + 2 <= length < len(prompt) + 5
            assert (counts.connections_lost, counts.tail_replays, counts.tail_replayed_tokens) == (1, 1, len(prompt) + 5 - length)
            assert (counts.replays, counts.replayed_tokens, counts.cache_misses) == (0, 0, 0) and session.epoch == 1
            assert "adopted 1 parked sessions" in daemons[1].log()
            session.release()
        finally:
            for client in clients:
                client.close()


@pytest.mark.parametrize("mode", ["process", "batched"])
def test_a_copy_written_behind_never_outlives_a_truncate_of_a_parked_session(model_path, socket_dir, tmp_path, prompt_ids, mode):
    """Issue 26 item 1, end to end through the router: a session idle long enough is copied to disk
    (--persist-after) and parked (--park-after); the router truncates it to 20 and regenerates other tokens
    from there past the copy's length; the daemon is SIGKILLed and restarted on its socket and spill dir. The
    copy of the old history must not come back: the next logits are those of the session's history now, bit
    for bit (a LocalChain of the same tokens in the same chunks), in both modes. On the old code the successor
    adopted the copy of length 30, the router replayed a 5-token tail onto it and the logits were the old
    history's (max |delta| 4.75, another argmax)."""
    from kvpool.local.chain import LocalChain
    from kvpool.router.router import Router

    n_ctx = 128
    before = (prompt_ids[0] + prompt_ids[1])[:30]
    after = before[:20] + prompt_ids[1][::-1][:16]  # what the session holds from the truncate on
    assert len(after) == 36 and after[20:30] != before[20:30]
    spill_dir = tmp_path / f"spill-{mode}"

    def serve() -> DaemonProcess:
        return DaemonProcess(model_path, socket_dir / f"regen-{mode}.sock", "--threads", "1", "--n-ctx", str(n_ctx), "--max-sessions", "2",
                             "--mode", mode, "--seqs-per-worker", "2", "--spill-dir", str(spill_dir), "--spill-disk-budget", "64MiB",
                             # a copy after 2 s idle: far above the few steps between the restore and the kill on a slow machine
                             "--persist-after", "2", "--park-after", "3")

    def steps(append, truncate) -> np.ndarray:
        append(0, before)
        yield
        truncate(20)
        append(20, after[20:30])
        append(30, after[30:35])
        yield
        return append(35, after[35:36])

    with LocalChain([model_path]) as chain, chain.new_session(n_ctx) as alone:
        plan = steps(alone.append, alone.truncate)
        next(plan), next(plan)
        with pytest.raises(StopIteration) as reference:
            next(plan)
    expected = reference.value.value

    daemon = serve()
    client = daemon.client()
    try:
        session = Router([client]).session("regen", n_ctx=n_ctx)
        plan = steps(session.append_at, session.truncate)
        next(plan)
        wait_until(lambda: client.stats().counters.get("persisted", 0) >= 1, "the copy written behind")
        wait_until(lambda: [row.tier for row in client.stats().sessions] == ["ram"], "the idle session parked")
        next(plan)  # truncated while parked, regenerated past the copy's length
        _killed(daemon)
        daemon = serve()
        with pytest.raises(StopIteration) as got:
            next(plan)
        assert np.array_equal(got.value.value, expected), float(np.abs(got.value.value - expected).max())
        counts = session.counts
        assert counts.tail_replays == 0 and counts.replays == 1  # nothing of the old history adopted: replayed from 0
        assert "adopted 0 parked sessions" in daemon.log()
        session.release()
        assert client.stats().integrity == "ok"
    finally:
        client.close()
        daemon.stop()

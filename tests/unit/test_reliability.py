"""Reliability (issue 8) without llama.cpp: a reply never reaches another request (on a daemon of fake
workers, tests/support/fake_daemon.py, and on a lying toy server), a late cancel's abort flag, shared-memory
sizing and the refusal when /dev/shm cannot hold the segments (fake shard files of the bundled model's
shapes), worker names. What needs real processes (no process outlives its parent, a killed supervisor, a
dead free worker's pid, SIGSTOPped workers past the request timeout, logits larger than the segment exact
against llama.cpp, a clean SIGTERM) stays in tests/daemon/test_reliability.py.

Waits are hang guards only: every one waits for an event, never for an amount of time to pass.
"""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.daemon.pool.handle import PoolSpec
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.pool.shm_room import free_shared_memory_bytes
from kvpool.daemon.service import KvService
from kvpool.wire.framing import FRAME_HEADER
from kvpool.wire.protocol import (
    PROTOCOL_VERSION,
    Append,
    Done,
    ErrorReply,
    Hello,
    HelloReply,
    ShardDescription,
    Stats,
    StatsReply,
    decode_reply,
    decode_request,
    encode,
)
from kvpool.wire.shape import ShardShape
from tests.support.daemons import wait_until
from tests.support.fake_daemon import N_EMBD, fake_shard_file
from tests.support.fake_worker import expected_rows, fake_kinds
from tests.support.service import run_on_service
from workers.server.segment import LOGIT_ROWS_IN_SEGMENT, SegmentRegions
from workers.server.spec import WorkerSpec

HANG_GUARD_S = 600.0
SMALL = ("--threads", "1", "--n-ctx", "64", "--max-sessions", "2")



# ---- 1. a reply belongs to its request ----------------------------------------------------------------


def test_a_timed_out_request_never_hands_its_reply_to_the_next_request(serve, fake_shards):
    # Three places for A, B and B-again: no eviction, so A's fate does not depend on the order of events.
    daemon = serve(fake_shards[0], "--threads", "1", "--n-ctx", "2048", "--max-sessions", "3", name="crosstalk")
    client = Client(daemon.socket, timeout_s=0.05, direct=False)
    # Every worker stopped: A's admission cannot complete before the client gives up, on any machine.
    with daemon.stopped():
        with pytest.raises(TimeoutError):
            client.append("A", 1, 0, tokens=[index % 256 for index in range(100, 1100)], n_ctx=2048)
    client.timeout_s = HANG_GUARD_S
    # The daemon finishes A's append now and answers on the connection the timeout closed.
    b = client.append("B", 1, 0, tokens=[1, 2, 3], n_ctx=2048)
    assert b.length == 3 and b.rows.shape == (3, N_EMBD)
    with daemon.client(timeout_s=HANG_GUARD_S) as other:
        again = other.append("B-again", 1, 0, tokens=[1, 2, 3], n_ctx=2048)
        assert np.array_equal(b.rows, again.rows)  # B's own rows, not A's
        assert np.array_equal(b.rows, expected_rows(other.hello.shard.shape, np.asarray([1, 2, 3], np.int32)))
        wait_until(lambda: any(r.session_id == "A" and not r.in_flight for r in other.stats().sessions), "A idle")
        assert {r.session_id: r.length for r in other.stats().sessions}["A"] == 1000  # nothing of A was lost
    client.close()


def test_replies_echo_the_request_id_and_undecodable_frames_get_id_zero(serve, fake_shards):
    daemon = serve(fake_shards[0], *SMALL, name="ids")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(HANG_GUARD_S)
        sock.connect(str(daemon.socket))

        def read():
            header = sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
            (size,) = FRAME_HEADER.unpack(header)
            return decode_reply(sock.recv(size, socket.MSG_WAITALL))

        sock.sendall(encode(Hello(version=PROTOCOL_VERSION, request_id=5)))
        assert read().request_id == 5
        sock.sendall(encode(Stats(request_id=11)) + encode(Stats(request_id=12)) + FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1")
        # answered as each completes: matched by id, in any order
        replies = {reply.request_id: type(reply) for reply in (read(), read(), read())}
        assert replies == {11: StatsReply, 12: StatsReply, 0: ErrorReply}


class _LyingDaemon:
    """A socket that speaks the protocol but answers the first Truncate with another request's id."""

    def __init__(self, path: pathlib.Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen()
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        shard = ShardDescription(shape=ShardShape(layer_start=0, layer_stop=30, total_layers=30, n_embd=576, n_vocab=49152), model_path="x")
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            lie = self.connections == 1
            with connection:
                while True:
                    header = connection.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
                    if len(header) < FRAME_HEADER.size:
                        break
                    request = decode_request(connection.recv(FRAME_HEADER.unpack(header)[0], socket.MSG_WAITALL))
                    if isinstance(request, Hello):
                        reply = HelloReply(version=PROTOCOL_VERSION, shard=shard, max_n_ctx=64, default_n_ctx=64, max_request_bytes=1024)
                        reply.request_id = request.request_id
                    else:
                        reply = Done(length=request.length, request_id=request.request_id + (1 if lie else 0))
                    connection.sendall(encode(reply))

    def close(self) -> None:
        self.listener.close()


def test_a_reply_for_another_request_closes_the_connection_and_the_next_call_reconnects(sockets):
    path = sockets / "liar.sock"
    liar = _LyingDaemon(path)
    try:
        with Client(path, timeout_s=HANG_GUARD_S) as client:
            with pytest.raises(ConnectionLost, match="request 3 where request 2 was expected"):
                client.truncate("s", 1, 7)
            assert client.truncate("s", 1, 9) == 9  # a new connection, answered honestly
            assert liar.connections == 2
        with pytest.raises(ConnectionLost, match="closed"):
            client.truncate("s", 1, 1)  # a closed client stays closed
    finally:
        liar.close()


# ---- 3. the smaller defects ------------------------------------------------------------------------------


def test_an_abort_flag_left_by_a_late_cancel_does_not_abort_the_next_compute(fake_shards, tmp_path):
    """A cancel landing as an append finishes leaves the worker's abort flag set; calibration and the
    next append on that worker must clear it rather than abort (a fake worker aborts on a set flag as
    llama.cpp's abort callback does)."""

    async def scenario(service: KvService, pool: WorkerPool) -> None:
        [worker] = pool.workers()
        worker.set_abort(True)
        await service.calibrator.calibrate(128)
        assert service.calibrator.charge_for(64) >= service.calibrator.theoretical_kv_bytes(64)
        worker.set_abort(True)
        reply = await service.append(Append(session_id="s", epoch=1, start_pos=0, tokens=[1, 2, 3], n_ctx=64))
        assert reply.length == 3
        service.check_integrity()

    run_on_service(fake_shards[0], tmp_path, scenario, kinds=fake_kinds(), max_sessions=1, n_ctx=128, threads=1)


def test_segments_are_sized_for_what_crosses_them_and_counted_in_the_books(serve, fake_files):
    last = fake_shard_file(fake_files, 20, 30, total_layers=30, n_embd=576, n_vocab=49152)  # the bundled model's last shard's shape
    daemon = serve(last, "--threads", "1", "--n-ctx", "2048", "--max-sessions", "2", name="segments")
    regions = SegmentRegions.for_shard(
        ShardShape(layer_start=20, layer_stop=30, total_layers=30, n_embd=576, n_vocab=49152), n_ctx=2048, max_request_bytes=64 * 1024**2
    )
    assert regions.output_bytes == LOGIT_ROWS_IN_SEGMENT * 49152 * 4  # not n_ctx rows of logits (384 MiB)
    with daemon.client() as client:
        stats = client.stats()
        assert stats.budget.shared_memory_bytes == 2 * regions.total_bytes < 16 * 1024**2
        assert stats.integrity == "ok"


def test_serve_refuses_to_start_when_dev_shm_cannot_hold_the_segments(fake_files, sockets):
    middle = fake_shard_file(fake_files, 10, 20, total_layers=30, n_embd=576)  # the bundled model's middle shard's shape
    row_bytes = 576 * 4
    n_ctx = free_shared_memory_bytes() // row_bytes + 1  # one segment alone is larger than what is free
    completed = subprocess.run(
        [sys.executable, "-m", "kvpool", "serve", "--model", str(middle), "--socket", str(sockets / "shm.sock"),
         "--n-ctx", str(n_ctx), "--max-request-bytes", str(n_ctx * row_bytes), "--max-sessions", "1"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert completed.returncode == 2
    [line] = completed.stderr.strip().splitlines()
    assert line.startswith("kvpool serve: error: /dev/shm has ") and "1 workers need" in line and "--shm-size" in line
    assert not (sockets / "shm.sock").exists()


def test_worker_names_are_unique_when_replacements_start_in_many_threads(fake_model):
    spec = PoolSpec(
        worker=WorkerSpec(shard_path=str(fake_model), segment=SegmentRegions(input_bytes=4, output_bytes=4), n_threads=1, flash_attn=False),
        size=1, ready_timeout_s=60, request_timeout_s=60,
    )
    pool = WorkerPool(spec)  # never started: only its naming is exercised
    names: list[str] = []
    barrier = threading.Barrier(8)

    def name_many() -> None:
        barrier.wait()
        names.extend(pool._next_number() for _ in range(500))

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=name_many) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_GUARD_S)
    finally:
        sys.setswitchinterval(previous)
    assert len(names) == len(set(names)) == 4000


def test_a_request_over_the_daemons_frame_limit_is_refused_before_it_is_sent(serve, fake_model):
    """The daemon refuses a frame over --max-request-bytes unread and closes the connection, as request 0, which no
    request's reply can be told from: the client, knowing the limit from the Hello, refuses it first (bad_request, the
    daemon's words), sends nothing, and its connection serves the next request."""
    with serve(fake_model, "--max-request-bytes", "1024", "--n-ctx", "1024").client(direct=False) as client:
        with pytest.raises(KvpoolError) as refused:
            client.append("s", 1, 0, tokens=[30000] * 400)  # ~1.2 KB of msgpack
        assert refused.value.code == "bad_request" and str(refused.value).endswith("exceeds the limit of 1024")
        assert client.append("s", 1, 0, tokens=[1, 2]).length == 2
        assert client.stats().counters["appends"] == 1

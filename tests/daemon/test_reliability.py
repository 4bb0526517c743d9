"""Reliability (issue 8): a reply never reaches another request, no process outlives its parent, and the
smaller defects: a late cancel's abort flag, a dead free worker, shared-memory sizing, worker names,
integrity under -O (tests/unit/test_books.py), a stalled worker. Real daemons on real shards throughout.

Waits are hang guards only: every one waits for an event, never for an amount of time to pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from kvpool.shard.bundled import bundled_model_path
from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.daemon.config import ServeConfig
from kvpool.launcher import Daemon, start_daemons
from kvpool.daemon.pool.pool import WorkerPool
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
from kvpool.wire.framing import FRAME_HEADER
from kvpool.daemon.pool.shm_room import free_shared_memory_bytes
from workers.server.segment import LOGIT_ROWS_IN_SEGMENT, SegmentRegions
from kvpool.daemon.service import KvService
from kvpool.wire.shape import ShardShape
from kvpool.shard.header import read_shard_info
from kvpool.daemon.supervisor import build_pool
from kvpool.daemon.pool.handle import PoolSpec
from workers.server.spec import WorkerSpec
from tests.support.daemons import DaemonProcess, private_socket_dir
from workers.runtime.model import ShardModel

HANG_GUARD_S = float(os.environ.get("KVPOOL_TEST_HANG_GUARD_S", "600"))
pytestmark = pytest.mark.timeout(3600)
SMALL = ("--threads", "1", "--n-ctx", "64", "--max-sessions", "2")


def _wait_until(predicate, what: str, guard_s: float = HANG_GUARD_S) -> float:
    """Poll until predicate() holds; returns the seconds it took. The guard only stops a hang."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > guard_s:
            pytest.fail(f"hang guard: {what} not true after {guard_s:.0f} s")
        time.sleep(0.02)
    return time.monotonic() - started


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def _frozen(pids):
    """SIGSTOP the processes for the block (deterministic 'busy'), SIGCONT them after."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _worker_of(client: Client, session_id: str) -> int:
    return next(row.worker_pid for row in client.stats().sessions if row.session_id == session_id)


# ---- 1. a reply belongs to its request ----------------------------------------------------------------


def test_a_timed_out_request_never_hands_its_reply_to_the_next_request(shards, socket_dir):
    # Three places for A, B and B-again: no eviction, so A's fate does not depend on the order of events.
    daemon = DaemonProcess(shards[0].path, socket_dir / "crosstalk.sock", "--threads", "1", "--n-ctx", "2048", "--max-sessions", "3")
    try:
        client = Client(daemon.socket, timeout_s=0.05)
        # Every worker frozen: A's admission cannot complete before the client gives up, on any machine.
        with _frozen(daemon.worker_pids()):
            with pytest.raises(TimeoutError):
                client.append("A", 1, 0, tokens=list(range(100, 1100)), n_ctx=2048)
        client.timeout_s = HANG_GUARD_S
        # The daemon finishes A's append now and answers on the connection the timeout closed.
        b = client.append("B", 1, 0, tokens=[1, 2, 3], n_ctx=2048)
        assert b.length == 3 and b.rows.shape == (3, 576)
        with daemon.client(timeout_s=HANG_GUARD_S) as other:
            again = other.append("B-again", 1, 0, tokens=[1, 2, 3], n_ctx=2048)
            assert np.array_equal(b.rows, again.rows)  # B's own rows, not A's
            _wait_until(lambda: any(r.session_id == "A" and not r.in_flight for r in other.stats().sessions), "A idle")
            assert {r.session_id: r.length for r in other.stats().sessions}["A"] == 1000  # nothing of A was lost
        client.close()
    finally:
        daemon.stop()


def test_replies_echo_the_request_id_and_undecodable_frames_get_id_zero(shards, socket_dir):
    daemon = DaemonProcess(shards[0].path, socket_dir / "ids.sock", *SMALL)
    try:
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
    finally:
        daemon.stop()


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


def test_a_reply_for_another_request_closes_the_connection_and_the_next_call_reconnects(tmp_path):
    path = pathlib.Path(private_socket_dir(tmp_path)) / "liar.sock"
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


# ---- 2. no process outlives its parent -----------------------------------------------------------------

LAUNCHER_PROGRAM = """
import pathlib, sys, time
from kvpool.launcher import start_daemons
[daemon] = start_daemons([pathlib.Path(sys.argv[1])], pathlib.Path(sys.argv[2]), ["--threads", "1", "--n-ctx", "64", "--max-sessions", "2"])
print(daemon.process.pid, *daemon.worker_pids(), flush=True)
time.sleep(3600)
"""


def test_daemons_and_workers_stop_when_the_program_that_started_them_is_killed(shards, socket_dir):
    program = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_PROGRAM, str(shards[0].path), str(socket_dir / "orphans")],
        stdout=subprocess.PIPE, text=True,
    )
    pids: list[int] = []
    try:
        pids.extend(int(pid) for pid in program.stdout.readline().split())
        assert len(pids) >= 3  # the daemon, its two workers (and its resource tracker)
        program.kill()
        program.wait()
        took = _wait_until(lambda: all(_gone(pid) for pid in pids), "the daemon and its workers gone")
        print(f"daemon and workers gone {took:.2f} s after SIGKILL of the program that started them")
        assert not (socket_dir / "orphans" / "shard0.sock").exists()
    finally:
        program.kill()
        program.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_daemon_started_from_a_thread_outlives_that_thread_but_not_the_process(shards, socket_dir):
    started: list[Daemon] = []
    thread = threading.Thread(target=lambda: started.extend(start_daemons([shards[0].path], socket_dir / "thread", list(SMALL))))
    thread.start()
    thread.join(HANG_GUARD_S)
    [daemon] = started
    try:
        time.sleep(0.5)  # PR_SET_PDEATHSIG would have fired when the thread ended; the lifeline does not
        with daemon.client() as client:
            assert client.stats().integrity == "ok"
    finally:
        assert daemon.stop() == 0


def test_a_killed_supervisor_takes_its_workers_and_segments_and_a_new_daemon_replaces_its_socket(shards, socket_dir):
    path = socket_dir / "killed.sock"
    before = set(os.listdir("/dev/shm"))
    killed = DaemonProcess(shards[0].path, path, *SMALL)
    workers = killed.worker_pids()
    segments = {name for name in set(os.listdir("/dev/shm")) - before if name.startswith("psm_")}
    assert len(workers) >= 2 and len(segments) >= 2  # workers and the resource tracker
    os.kill(killed.process.pid, signal.SIGKILL)
    killed.process.wait()
    took = _wait_until(lambda: all(_gone(pid) for pid in workers), "the killed supervisor's workers gone")
    print(f"workers gone {took:.2f} s after SIGKILL of their supervisor")
    _wait_until(lambda: not segments & set(os.listdir("/dev/shm")), "the killed supervisor's segments removed")
    assert path.exists()  # a killed daemon cannot remove its socket file
    replacement = DaemonProcess(shards[0].path, path, *SMALL)  # nothing answers there: the file is replaced
    try:
        with replacement.client() as client:
            assert client.append("after", 1, 0, tokens=[1, 2]).length == 2
        refused = subprocess.run(
            [sys.executable, "-m", "kvpool", "serve", "--model", str(shards[0].path), "--socket", str(path), *SMALL],
            capture_output=True, text=True, timeout=HANG_GUARD_S,
        )
        assert refused.returncode == 2
        assert refused.stderr.strip() == f"kvpool serve: error: another daemon is serving on {path}"
        with replacement.client() as client:
            assert client.stats().sessions[0].length == 2  # the live daemon was not disturbed
    finally:
        replacement.stop()
        killed.stop()


# ---- 3. the smaller defects ------------------------------------------------------------------------------


def test_an_abort_flag_left_by_a_late_cancel_does_not_abort_the_next_compute(shards, tmp_path, resource_tracker_running):
    """A cancel landing as an append finishes leaves the worker's abort flag set; calibration and the
    next append on that worker must clear it rather than abort."""
    info = read_shard_info(shards[0].path)
    config = ServeConfig(model=shards[0].path, socket=tmp_path / "unused.sock", max_sessions=1, n_ctx=128, threads=1)
    pool = build_pool(config, info)

    async def scenario() -> None:
        ready = await asyncio.to_thread(pool.start)
        shard = ShardDescription(shape=ready.shape, model_path=str(shards[0].path))
        service = KvService(config, pool, shard, ready.kv_bytes_per_position)
        try:
            [worker] = pool.workers()
            worker.set_abort(True)
            await service.calibrator.calibrate(128)
            assert service.calibrator.charge_for(64) >= service.calibrator.theoretical_kv_bytes(64)
            worker.set_abort(True)
            reply = await service.append(Append(session_id="s", epoch=1, start_pos=0, tokens=[1, 2, 3], n_ctx=64))
            assert reply.length == 3
            service.check_integrity()
        finally:
            service.close()

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


def test_an_admission_that_must_evict_works_while_a_dead_free_worker_awaits_housekeeping(shards, socket_dir):
    daemon = DaemonProcess(shards[0].path, socket_dir / "deadfree.sock", *SMALL, "--housekeeping-interval", "3600", "--spill-budget", "0")
    try:
        with daemon.client() as client:
            client.append("old", 1, 0, tokens=[1, 2, 3])
            [free] = [worker for worker in client.stats().workers if worker.state == "free"]
            os.kill(free.pid, signal.SIGKILL)
            _wait_until(lambda: _gone(free.pid), "the free worker dead")
            # the only usable worker is old's: evict it, or wait for the dead one's replacement; never lend the dead one
            new = client.append("new", 1, 0, tokens=[4, 5, 6])
            assert new.admitted and new.length == 3
            try:
                assert client.append("old", 1, 3, tokens=[7]).length == 4  # it waited for the replacement
            except KvpoolError as evicted:
                assert evicted.code == "cache_miss" and evicted.reason == "evicted"

            def replaced() -> bool:
                stats = client.stats()
                return len(stats.workers) == 2 and free.pid not in {w.pid for w in stats.workers} and stats.integrity == "ok"

            _wait_until(replaced, "the dead worker replaced without housekeeping")
            assert client.stats().counters["worker_restarts"] == 1
    finally:
        daemon.stop()


def test_segments_are_sized_for_what_crosses_them_and_counted_in_the_books(shards, socket_dir):
    last = shards[-1]
    daemon = DaemonProcess(last.path, socket_dir / "segments.sock", "--threads", "1", "--n-ctx", "2048", "--max-sessions", "2")
    try:
        regions = SegmentRegions.for_shard(
            ShardShape(layer_start=20, layer_stop=30, total_layers=30, n_embd=576, n_vocab=49152), n_ctx=2048, max_request_bytes=64 * 1024**2
        )
        assert regions.output_bytes == LOGIT_ROWS_IN_SEGMENT * 49152 * 4  # not n_ctx rows of logits (384 MiB)
        with daemon.client() as client:
            stats = client.stats()
            assert stats.budget.shared_memory_bytes == 2 * regions.total_bytes < 16 * 1024**2
            assert stats.integrity == "ok"
    finally:
        daemon.stop()


def test_every_row_of_logits_larger_than_the_segment_arrives_exact(socket_dir, prompt_ids):
    whole = bundled_model_path()
    prompt = prompt_ids[1][:40]
    assert len(prompt) > LOGIT_ROWS_IN_SEGMENT
    with ShardModel(whole, n_threads=1) as model, model.new_context(256) as context:
        expected = np.array(context.append(0, tokens=np.array(prompt), output_rows="all"), copy=True)
    daemon = DaemonProcess(whole, socket_dir / "alllogits.sock", "--threads", "1", "--n-ctx", "256", "--max-sessions", "1")
    try:
        with daemon.client() as client:
            rows = client.append("all", 1, 0, tokens=prompt, output_rows="all").rows
            assert rows.shape == (len(prompt), 49152)
            assert np.array_equal(rows, expected)
            assert client.stats().budget.shared_memory_bytes < 8 * 1024**2
    finally:
        daemon.stop()


def test_serve_refuses_to_start_when_dev_shm_cannot_hold_the_segments(shards, socket_dir):
    middle = shards[1]
    row_bytes = 576 * 4
    n_ctx = free_shared_memory_bytes() // row_bytes + 1  # one segment alone is larger than what is free
    completed = subprocess.run(
        [sys.executable, "-m", "kvpool", "serve", "--model", str(middle.path), "--socket", str(socket_dir / "shm.sock"),
         "--n-ctx", str(n_ctx), "--max-request-bytes", str(n_ctx * row_bytes), "--max-sessions", "1"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert completed.returncode == 2
    [line] = completed.stderr.strip().splitlines()
    assert line.startswith("kvpool serve: error: /dev/shm has ") and "1 workers need" in line and "--shm-size" in line
    assert not (socket_dir / "shm.sock").exists()


def test_worker_names_are_unique_when_replacements_start_in_many_threads(shards):
    spec = PoolSpec(
        worker=WorkerSpec(shard_path=str(shards[0].path), segment=SegmentRegions(input_bytes=4, output_bytes=4), n_threads=1, flash_attn=False),
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


def test_a_stalled_worker_is_killed_at_the_request_timeout_and_the_others_continue(shards, socket_dir):
    daemon = DaemonProcess(shards[0].path, socket_dir / "stall.sock", *SMALL, "--request-timeout", "20")
    try:
        with daemon.client(direct=False) as client:
            client.append("stalled", 1, 0, tokens=[1, 2, 3])
            client.append("other", 1, 0, tokens=[4, 5])
            pid = _worker_of(client, "stalled")
            with _frozen([pid]):
                with pytest.raises(KvpoolError) as lost:
                    client.append("stalled", 1, 3, tokens=[4])
            assert lost.value.code == "worker_lost" and "did not answer" in str(lost.value)
            _wait_until(lambda: _gone(pid), "the stalled worker killed")
            with pytest.raises(KvpoolError) as miss:
                client.append("stalled", 1, 3, tokens=[4])
            assert miss.value.code == "cache_miss" and miss.value.reason == "worker_lost"
            assert client.append("other", 1, 2, tokens=[6]).length == 3

            def replaced() -> bool:
                stats = client.stats()
                return len(stats.workers) == 2 and pid not in {w.pid for w in stats.workers} and stats.integrity == "ok"

            _wait_until(replaced, "the stalled worker replaced")
    finally:
        daemon.stop()


def test_a_worker_stalled_under_a_direct_append_is_killed_at_the_request_timeout(shards, socket_dir):
    daemon = DaemonProcess(shards[0].path, socket_dir / "stall-direct.sock", *SMALL, "--request-timeout", "5")
    try:
        with daemon.client() as client, daemon.client(direct=False) as observer:
            client.append("stalled", 1, 0, tokens=[1, 2, 3])
            client.append("stalled", 1, 3, tokens=[4])  # bound: the next append goes to the worker directly
            client.append("other", 1, 0, tokens=[4, 5])
            pid = _worker_of(observer, "stalled")
            with _frozen([pid]):
                with pytest.raises(KvpoolError) as lost:
                    client.append("stalled", 1, 4, tokens=[5])
            # the channel ended with the killed worker; the daemon's answer is the contract's
            assert (lost.value.code, lost.value.reason) in {("worker_lost", None), ("cache_miss", "worker_lost")}, lost.value
            _wait_until(lambda: _gone(pid), "the stalled worker killed")
            assert client.append("other", 1, 2, tokens=[6]).length == 3
            _wait_until(lambda: (stats := observer.stats()).integrity == "ok" and pid not in {w.pid for w in stats.workers}, "the worker replaced")
    finally:
        daemon.stop()


# ---- a clean stop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [(), ("--mode", "batched", "--seqs-per-worker", "2")], ids=["process", "batched"])
def test_a_daemon_stopped_with_sigterm_after_a_busy_run_prints_no_traceback(socket_dir, prompt_ids, mode):
    """Every view of a worker's segment (the direct channel's control words and abort flag, a batched
    worker's input and output regions) is released before the segment closes, in the worker and in the
    supervisor: SharedMemory.close() then succeeds and nothing is printed on the way out."""
    daemon = DaemonProcess(bundled_model_path(), socket_dir / f"clean-stop-{len(mode)}.sock", *SMALL, *mode)
    prompt = prompt_ids[0][:8]
    try:
        with daemon.client() as client, daemon.client(direct=False) as plain:
            for session in ("a", "b", "c"):  # three sessions in two places: one is parked for the third
                client.append(session, 1, 0, tokens=prompt)
                client.append(session, 1, 8, tokens=[5], output_rows="all")  # on the direct channel in process mode
            for session in ("a", "b", "c"):  # the parked one is restored
                client.append(session, 1, 9, tokens=[6])
            plain.park("c", 1)
            assert client.append("c", 1, 10, tokens=[7]).restored
            counters = plain.stats().counters
            assert counters["restores"] >= 2 and counters["appends"] + counters["direct_appends"] == 10
            assert counters["direct_appends"] > 0 or mode
    finally:
        code = daemon.stop(sig=signal.SIGTERM)
    log = daemon.log()
    assert code == 0, log
    assert "kvpool serve: stopped" in log
    assert "Traceback" not in log and "Exception ignored" not in log, log

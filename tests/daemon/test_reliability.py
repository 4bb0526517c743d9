"""Reliability (issue 8) where real processes are what is tested: no process outlives its parent, a killed
supervisor takes its workers and segments, a free worker SIGKILLed before housekeeping looks is never lent,
logits larger than the segment arrive exact against llama.cpp, SIGSTOPped workers are killed at the request
timeout, a SIGTERM after a busy run prints no traceback. Real daemons on real shards throughout. A reply
belonging to its request, a late cancel's abort flag, shared-memory sizing, the /dev/shm refusal and worker
names run without llama.cpp: tests/unit/test_reliability.py; integrity under -O: tests/unit/test_books.py.

Waits are hang guards only: every one waits for an event, never for an amount of time to pass.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from kvpool.client.client import Client, KvpoolError
from kvpool.daemon.supervisor import compute_semaphore_records
from kvpool.launcher import Daemon, start_daemons
from kvpool.shard.bundled import bundled_model_path
from tests.support.daemons import DaemonProcess, semaphore_listed
from workers.runtime.model import ShardModel
from workers.server import compute_semaphore
from workers.server.segment import LOGIT_ROWS_IN_SEGMENT

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


# ---- 1. no process outlives its parent -----------------------------------------------------------------

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


def _recorded_semaphore(daemon: DaemonProcess) -> int:
    return int(pathlib.Path(f"{compute_semaphore_records(daemon.socket)}.{daemon.process.pid}").read_text().split()[0])


def _records(socket_path) -> list[str]:
    prefix = compute_semaphore_records(socket_path)
    return sorted(name for name in os.listdir(prefix.parent) if name.startswith(prefix.name + "."))


def test_a_killed_supervisor_takes_its_workers_and_segments_and_a_new_daemon_replaces_its_socket(shards, socket_dir):
    """And its compute semaphore, which the kernel keeps when its creator dies: its workers remove it as they go."""
    path = socket_dir / "killed.sock"
    before = set(os.listdir("/dev/shm"))
    killed = DaemonProcess(shards[0].path, path, *SMALL)  # 1 thread, 2 workers: a semaphore of one unit bounds them
    left = _recorded_semaphore(killed)
    assert semaphore_listed(left)
    workers = killed.worker_pids()
    segments = {name for name in set(os.listdir("/dev/shm")) - before if name.startswith("psm_")}
    assert len(workers) >= 2 and len(segments) >= 2  # workers and the resource tracker
    os.kill(killed.process.pid, signal.SIGKILL)
    killed.process.wait()
    took = _wait_until(lambda: all(_gone(pid) for pid in workers), "the killed supervisor's workers gone")
    print(f"workers gone {took:.2f} s after SIGKILL of their supervisor")
    _wait_until(lambda: not segments & set(os.listdir("/dev/shm")), "the killed supervisor's segments removed")
    assert path.exists()  # a killed daemon cannot remove its socket file
    assert not semaphore_listed(left)  # its workers did, before they exited
    replacement = DaemonProcess(shards[0].path, path, *SMALL)  # nothing answers there: the file is replaced
    own = _recorded_semaphore(replacement)
    assert semaphore_listed(own) and _records(path) == [f".killed.sock.compute.{replacement.process.pid}"]  # the dead one's record cleared
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
        assert _recorded_semaphore(replacement) == own  # nor its semaphore
    finally:
        replacement.stop()
        killed.stop()
    assert not semaphore_listed(own) and _records(path) == []  # a stopped daemon removes its own


def test_a_daemon_killed_with_its_workers_leaves_its_semaphore_and_the_next_on_the_socket_removes_it(shards, socket_dir):
    path = socket_dir / "killed.sock"
    killed = DaemonProcess(shards[0].path, path, *SMALL)
    left = _recorded_semaphore(killed)
    workers = killed.worker_pids()
    os.kill(killed.process.pid, signal.SIGSTOP)  # it replaces no worker now
    for pid in workers:
        os.kill(pid, signal.SIGKILL)  # none left to find the supervisor gone
    os.kill(killed.process.pid, signal.SIGKILL)
    killed.process.wait()
    _wait_until(lambda: all(_gone(pid) for pid in workers), "the workers gone")
    assert semaphore_listed(left)  # nobody removed it
    replacement = DaemonProcess(shards[0].path, path, *SMALL)
    try:
        own = _recorded_semaphore(replacement)
        assert own != left and semaphore_listed(own) and not semaphore_listed(left)
        with replacement.client() as client:
            assert client.append("after", 1, 0, tokens=[1, 2]).length == 2
    finally:
        replacement.stop()
        killed.stop()
        compute_semaphore.remove(left)  # the test's own leak, were the daemon not to remove it
    assert not semaphore_listed(own) and _records(path) == []


# ---- 2. the smaller defects ------------------------------------------------------------------------------


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


def test_a_stalled_worker_is_killed_at_the_request_timeout_and_the_others_continue(shards, socket_dir):
    # 5 s, as below: far above any call of this daemon (its probe and its appends fill at most 64 cells)
    daemon = DaemonProcess(shards[0].path, socket_dir / "stall.sock", *SMALL, "--request-timeout", "5")
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

"""--keep-warm on a real daemon of the bundled model: an append on a worker's direct channel, which the supervisor
never sees, touches the daemon's stamp as the supervisor's own requests do (read here from the block itself, whose
name the spinners are started with); the spinners, one a CPU at idle priority, go with the daemon and are not among
its workers (Daemon.worker_pids)."""

from __future__ import annotations

import mmap
import os
import time

import psutil

from tests.support.daemons import DaemonProcess, exited_all, wait_until
from workers.server.keep_warm_stamp import BLOCK_BYTES, Stamp

OPTIONS = ("--n-ctx", "64", "--max-sessions", "1", "--calibration-cache", "off")
TOKENS = [1, 50, 60, 70, 80, 90, 100, 110, 120]


def _spinners(daemon: DaemonProcess) -> list[psutil.Process]:
    return [child for child in psutil.Process(daemon.process.pid).children() if "kvpool.daemon.keep_warm_spinner" in child.cmdline()]


def _argument(process: psutil.Process, name: str) -> str:
    command = process.cmdline()
    return command[command.index(name) + 1]


def test_a_direct_append_touches_the_stamp_and_the_spinners_go_with_the_daemon(model_path, socket_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the spinners' CPU locks: this test's own
    daemon = DaemonProcess(model_path, socket_dir / "warm.sock", "--keep-warm", "600", *OPTIONS)
    try:
        spinners = wait_until(lambda: _spinners(daemon), "the daemon's spinners")
        assert sorted(int(_argument(child, "--cpu")) for child in spinners) == sorted(os.sched_getaffinity(daemon.process.pid))
        assert not {child.pid for child in spinners} & set(daemon.worker_pids())
        wait_until(lambda: all(os.sched_getscheduler(child.pid) == os.SCHED_IDLE for child in spinners), "the spinners at idle priority")
        fd = os.open(f"/dev/shm/{_argument(spinners[0], '--block')}", os.O_RDONLY)
        block = mmap.mmap(fd, BLOCK_BYTES, prot=mmap.PROT_READ)
        os.close(fd)
        stamp = Stamp(bytearray(block[:BLOCK_BYTES]))  # a copy: read it again after each request
        assert stamp.last_request == float("-inf")
        with daemon.client() as client:
            client.append("s", 1, 0, tokens=TOKENS[:8])  # admitted through the supervisor (Gate.leave touches)
            first = Stamp(bytearray(block[:BLOCK_BYTES])).last_request
            before = time.monotonic()
            direct_before = client.stats().counters.get("direct_appends", 0)
            client.append("s", 1, 8, tokens=TOKENS[8:])  # on the worker's direct channel: only the worker touches
            second = Stamp(bytearray(block[:BLOCK_BYTES])).last_request
            stats = client.stats()
        block.close()
        assert stats.counters["direct_appends"] == direct_before + 1  # it did go direct
        assert first < before <= second, (first, before, second)
        assert "the last session request ended" in stats.keep_warm
    finally:
        assert daemon.stop() == 0
    assert exited_all(spinners, "the spinners after the daemon stopped") == []

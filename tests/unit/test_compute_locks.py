"""The compute locks that bound how many workers of one daemon compute at once (workers.server.compute_locks), in
plain processes: the bound, and a dead holder's slot freed by the kernel. (A waiter waits on a slot chosen in
advance, even when another frees first: evidence/daemon-overhead/README.md, "Stop 54".)"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import signal

import pytest

from workers.server.compute_locks import ComputeLocks

HANG_GUARD_S = 600


@pytest.fixture
def lock_file(tmp_path: pathlib.Path) -> str:
    """A lock file as the pool creates it (kvpool.daemon.pool.pool): one byte a slot."""
    path = tmp_path / "compute"
    path.write_bytes(b"\0")
    return str(path)


def _hold(path: str, slot_count: int, preferred: int, ready, release) -> None:
    with ComputeLocks(path, slot_count, preferred):
        ready.set()
        if release is None:
            signal.pause()  # killed while holding the slot
        else:
            release.wait()  # no timeout of its own: a slot freed by one would pass for the waiter's (the test kills it)


@pytest.fixture
def holders():
    """Start a process holding a compute slot: holder(path, slot_count, preferred, killed=...) -> (process, ready,
    release); every one still running is killed after the test."""
    context = multiprocessing.get_context("fork")  # no resource tracker process left behind
    started = []

    def holder(path: str, slot_count: int, preferred: int, *, killed: bool = False):
        ready, release = context.Event(), None if killed else context.Event()
        process = context.Process(target=_hold, args=(path, slot_count, preferred, ready, release))
        process.start()
        started.append(process)
        return process, ready, release

    yield holder
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(HANG_GUARD_S)


def test_compute_locks_bound_the_workers_computing_and_a_dead_holder_frees_its_slot(lock_file, holders):
    holder, holder_ready, _ = holders(lock_file, 1, 0, killed=True)
    assert holder_ready.wait(HANG_GUARD_S)
    waiter, waiter_ready, release = holders(lock_file, 1, 0)
    assert not waiter_ready.wait(0.5)  # the one slot is held
    os.kill(holder.pid, signal.SIGKILL)  # its slot freed by the kernel
    holder.join(HANG_GUARD_S)
    assert waiter_ready.wait(HANG_GUARD_S)
    release.set()
    waiter.join(HANG_GUARD_S)
    assert waiter.exitcode == 0

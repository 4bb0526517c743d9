"""The compute locks that bound how many workers of one daemon compute at once (workers.server.compute_locks), in
plain processes: the bound, a dead holder's slot freed by the kernel, and a waiter that takes whichever slot frees
first (before stop 54 it waited on a slot chosen in advance while the other stood free)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import pathlib
import signal
import time

import pytest

from tests.support.daemons import wait_until
from workers.server.compute_locks import BELL_CHECK_S, ComputeLocks, bell_path

HANG_GUARD_S = 600


@pytest.fixture
def lock_file(tmp_path: pathlib.Path) -> str:
    """A lock file and its bell, as the pool creates them (kvpool.daemon.pool.pool)."""
    path = tmp_path / "compute"
    path.write_bytes(b"\0\0")
    os.mkfifo(bell_path(str(path)), 0o600)
    return str(path)


def _hold(path: str, slot_count: int, preferred: int, ready, release, bell_check_s: float) -> None:
    with ComputeLocks(path, slot_count, preferred, bell_check_s=bell_check_s):
        ready.set()
        if release is None:
            signal.pause()  # killed while holding the slot
        else:
            release.wait()  # no timeout of its own: a slot freed by one would pass for the waiter's (the test kills it)


@pytest.fixture
def holders():
    """Start a process holding a compute slot: holder(path, slot_count, preferred, killed=..., bell_check_s=...) ->
    (process, ready, release); every one still running is killed after the test."""
    context = multiprocessing.get_context("fork")  # no resource tracker process left behind
    started = []

    def holder(path: str, slot_count: int, preferred: int, *, killed: bool = False, bell_check_s: float = BELL_CHECK_S):
        ready, release = context.Event(), None if killed else context.Event()
        process = context.Process(target=_hold, args=(path, slot_count, preferred, ready, release, bell_check_s))
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
    os.kill(holder.pid, signal.SIGKILL)  # its slot freed by the kernel, with no ring
    holder.join(HANG_GUARD_S)
    assert waiter_ready.wait(HANG_GUARD_S)
    release.set()
    waiter.join(HANG_GUARD_S)
    assert waiter.exitcode == 0


def test_a_waiter_takes_whichever_slot_frees_first_and_the_next_waits_for_the_other(lock_file, holders):
    """Two slots held (one by each holder); two waiters that prefer slot 0 queue, the first in line woken by the bell
    alone (its own look at the slots once in 10 hang guards: never within the test). The holder of slot 1 lets it go: a waiter
    takes it, though slot 0, the one they prefer, is still held (before the fix it waited on slot 0: its hang guard
    below; a bell that did not ring: the same); the other waits on until slot 0 frees too."""
    first, first_ready, first_release = holders(lock_file, 2, 0)
    assert first_ready.wait(HANG_GUARD_S)
    second, second_ready, second_release = holders(lock_file, 2, 1)
    assert second_ready.wait(HANG_GUARD_S)
    waiters = [holders(lock_file, 2, 0, bell_check_s=10 * HANG_GUARD_S) for _ in range(2)]
    assert not any(ready.wait(0.3) for _process, ready, _release in waiters)  # every slot held
    wait_until(lambda: _line_held(lock_file, 2), "a waiter at the head of the line")
    second_release.set()  # slot 1 frees; slot 0 stays held
    second.join(HANG_GUARD_S)
    readies = [ready for _process, ready, _release in waiters]
    assert _one_of(readies, HANG_GUARD_S), "no waiter took the slot that freed"
    assert sum(ready.is_set() for ready in readies) == 1 and not _one_of([r for r in readies if not r.is_set()], 0.3)  # one slot free: one waiter
    first_release.set()
    first.join(HANG_GUARD_S)
    assert all(ready.wait(HANG_GUARD_S) for ready in readies)
    for process, _ready, release in waiters:
        release.set()
        process.join(HANG_GUARD_S)
        assert process.exitcode == 0


def _line_held(path: str, slot_count: int) -> bool:
    """Whether a process holds the waiters' line (the range after the slots): tried, and let go if this one got it."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot_count)
    except OSError:
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, slot_count)
        return False
    finally:
        os.close(fd)


def test_one_slot_needs_no_bell(tmp_path, holders):
    """With one slot (--threads equal to --threads-per-worker) the pool makes no FIFO and a waiter waits on the
    slot's lock; a tool that makes its own lock file (scripts/probe_direct_path.py) needs none either."""
    path = tmp_path / "compute"
    path.write_bytes(b"\0")
    holder, ready, release = holders(str(path), 1, 0)
    assert ready.wait(HANG_GUARD_S)
    waiter, waiter_ready, waiter_release = holders(str(path), 1, 0)
    assert not waiter_ready.wait(0.3)
    release.set()
    assert waiter_ready.wait(HANG_GUARD_S)
    waiter_release.set()
    for process in (holder, waiter):
        process.join(HANG_GUARD_S)
        assert process.exitcode == 0
    assert not pathlib.Path(bell_path(str(path))).exists()


def _one_of(events, timeout_s: float) -> bool:
    """Whether any of `events` is set within `timeout_s` (looked at every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if any(event.is_set() for event in events):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)

"""The compute semaphore that bounds how many workers of one daemon compute at once (workers.server.
compute_semaphore), in plain processes: the bound, a waiter handed whichever unit frees first, a dead holder's unit
given back by the kernel, a live daemon's record left alone, and the semaphore a dead daemon left removed by the next."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pathlib
import signal
import time

import pytest

from tests.support.daemons import semaphore_listed
from workers.server import compute_semaphore
from workers.server.compute_semaphore import ComputeSemaphore, ComputeSemaphoreError

HANG_GUARD_S = 600


def _waiters_reach(semaphore_id: int, count: int) -> None:
    """Wait (hang guard) until `count` processes wait for a unit: a waiter that has not asked yet proves nothing."""
    deadline = time.monotonic() + HANG_GUARD_S
    while compute_semaphore.waiting(semaphore_id) < count:
        assert time.monotonic() < deadline, f"{count} waiters on {semaphore_id} within {HANG_GUARD_S} s"
        time.sleep(0.01)


@pytest.fixture
def semaphores(tmp_path: pathlib.Path):
    """Create a semaphore of n units as the pool does: make(n, name) -> Created; every one destroyed after the test
    (also one a test dropped as a killed daemon would: removed by id)."""
    made: list[compute_semaphore.Created] = []

    def make(units: int, name: str = "compute") -> compute_semaphore.Created:  # recorded at tmp_path/<name>.<pid>
        made.append(compute_semaphore.create(str(tmp_path / name), units))
        return made[-1]

    yield make
    for created in made:
        if created.descriptor >= 0:
            compute_semaphore.destroy(created)
        else:  # dropped
            compute_semaphore.remove(created.id)


def _killed(created: compute_semaphore.Created) -> None:
    """What a daemon killed with its workers leaves: the record unlocked (its descriptor closed by the kernel)."""
    os.close(created.descriptor)
    created.descriptor = -1


def _hold(semaphore_id: int, ready, release) -> None:
    with ComputeSemaphore(semaphore_id):
        ready.set()
        if release is None:
            signal.pause()  # killed while holding its unit
        else:
            release.wait()  # no timeout of its own: a unit freed by one would pass for the waiter's (the test kills it)


@pytest.fixture
def holders():
    """Start a process that takes a unit and holds it: holder(semaphore_id, killed=...) -> (process, ready, release);
    every one still running is killed after the test."""
    context = multiprocessing.get_context("fork")  # no resource tracker process left behind
    started = []

    def holder(semaphore_id: int, *, killed: bool = False):
        ready, release = context.Event(), None if killed else context.Event()
        process = context.Process(target=_hold, args=(semaphore_id, ready, release))
        process.start()
        started.append(process)
        return process, ready, release

    yield holder
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(HANG_GUARD_S)


def test_the_semaphore_bounds_the_workers_computing_and_a_dead_holders_unit_comes_back(semaphores, holders):
    semaphore = semaphores(1)
    holder, holder_ready, _ = holders(semaphore.id, killed=True)
    assert holder_ready.wait(HANG_GUARD_S)
    waiter, waiter_ready, release = holders(semaphore.id)
    _waiters_reach(semaphore.id, 1)
    assert not waiter_ready.is_set()  # the one unit is held
    os.kill(holder.pid, signal.SIGKILL)  # SEM_UNDO: the kernel gives its unit back
    holder.join(HANG_GUARD_S)
    assert waiter_ready.wait(HANG_GUARD_S)
    release.set()
    waiter.join(HANG_GUARD_S)
    assert waiter.exitcode == 0


@pytest.mark.parametrize("freed", [0, 1])
def test_a_waiter_takes_whichever_unit_frees_first(semaphores, holders, freed):
    """Two units, both held: the waiter goes on when either holder lets go (the fcntl locks before stop 55 made it
    wait for one chosen in advance, even while the other stood free)."""
    semaphore = semaphores(2)
    held = [holders(semaphore.id) for _ in range(2)]
    for _, ready, _ in held:
        assert ready.wait(HANG_GUARD_S)
    waiter, waiter_ready, waiter_release = holders(semaphore.id)
    _waiters_reach(semaphore.id, 1)
    assert not waiter_ready.is_set()  # both units held: a third computes only when one frees
    process, _, release = held[freed]
    release.set()
    process.join(HANG_GUARD_S)
    assert waiter_ready.wait(HANG_GUARD_S)
    for _, _, each in held:
        each.set()
    waiter_release.set()
    waiter.join(HANG_GUARD_S)
    assert waiter.exitcode == 0


def _daemon(prefix: str, made, stop) -> None:
    created = compute_semaphore.create(prefix, 2)
    made.put(created.id)
    stop.wait()  # no timeout of its own: the test kills it


def test_a_live_daemons_record_is_left_alone_and_a_killed_ones_semaphore_is_removed_by_the_next(semaphores, tmp_path):
    """Another daemon on the socket (a process of its own) keeps its semaphore while it lives, whatever starts beside
    it; killed with its workers (nothing removed it), the next daemon's start removes it and its record."""
    prefix = str(tmp_path / "compute")
    context = multiprocessing.get_context("fork")
    made, stop = context.Queue(), context.Event()
    other = context.Process(target=_daemon, args=(prefix, made, stop))
    other.start()
    try:
        theirs = made.get(timeout=HANG_GUARD_S)
        mine = semaphores(2)  # a daemon starting while the other still stops (or starts): not kept waiting
        compute_semaphore.clear_left_behind(prefix)  # nor does a daemon with no bound touch the other's
        assert semaphore_listed(theirs) and semaphore_listed(mine.id)
        assert sorted(os.listdir(tmp_path)) == sorted([f"compute.{other.pid}", f"compute.{os.getpid()}"])
        os.kill(other.pid, signal.SIGKILL)  # killed with its workers: the record's lock goes, the semaphore stays
        other.join(HANG_GUARD_S)
        assert semaphore_listed(theirs)
        compute_semaphore.destroy(mine)
        again = semaphores(2)  # the next daemon on the socket
        assert not semaphore_listed(theirs) and semaphore_listed(again.id)
        assert os.listdir(tmp_path) == [f"compute.{os.getpid()}"]
        assert pathlib.Path(again.path).read_text().split()[0] == str(again.id)
        compute_semaphore.destroy(again)
        assert not semaphore_listed(again.id) and os.listdir(tmp_path) == []
    finally:
        if other.is_alive():
            other.kill()
        other.join(HANG_GUARD_S)
        with contextlib.suppress(NameError):
            compute_semaphore.remove(theirs)


def test_a_daemon_with_no_bound_clears_a_dead_ones_semaphore(semaphores, tmp_path):
    left = semaphores(1)
    _killed(left)
    compute_semaphore.clear_left_behind(str(tmp_path / "compute"))
    assert not semaphore_listed(left.id) and not pathlib.Path(left.path).exists()
    compute_semaphore.clear_left_behind(str(tmp_path / "compute"))  # nothing there: nothing to do


def test_a_record_naming_another_semaphore_leaves_it_alone(semaphores, tmp_path):
    """The record's creator and ctime must be the kernel's: an id another semaphore has since is not removed."""
    other = semaphores(1, "other")
    creator, ctime = compute_semaphore._listed_as(other.id).split(":")
    for stale in (f"{other.id} {creator}:{int(ctime) - 1}", f"{other.id}", "not an id"):  # another ctime; no listing recorded; garbage
        (tmp_path / "compute.1").write_text(stale + "\n")  # a dead daemon's record, pid 1
        mine = semaphores(1)
        assert semaphore_listed(other.id) and semaphore_listed(mine.id) and not (tmp_path / "compute.1").exists()
        compute_semaphore.destroy(mine)


def test_a_process_that_exits_without_its_pools_close_removes_what_it_created(semaphores):
    """The lifeline's last resort (kvpool.daemon.lifeline) before it kills the workers and exits."""
    first, second = semaphores(1, "a"), semaphores(2, "b")
    compute_semaphore.destroy(first)
    compute_semaphore.remove_created()
    assert not semaphore_listed(second.id)


def test_units_out_of_range_are_refused_and_leave_nothing(tmp_path):
    for units in (0, compute_semaphore.MAX_UNITS + 1):
        with pytest.raises(ComputeSemaphoreError, match="1 to 32767 units"):
            compute_semaphore.create(str(tmp_path / "compute"), units)
    assert os.listdir(tmp_path) == []


def test_a_worker_whose_semaphore_was_removed_while_held_lets_go_quietly_and_cannot_take_it_again(semaphores):
    semaphore = semaphores(1)
    worker_side = ComputeSemaphore(semaphore.id)
    with worker_side:
        compute_semaphore.remove(semaphore.id)  # the daemon gone (a worker that found its supervisor dead removed it)
    with pytest.raises(ComputeSemaphoreError), worker_side:
        pass

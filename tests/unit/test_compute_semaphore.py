"""The compute semaphore that bounds how many workers of one daemon compute at once (workers.server.
compute_semaphore), in plain processes: the bound, a waiter handed whichever unit frees first, a dead holder's unit
given back by the kernel, and the semaphore a killed daemon left removed by the next."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import signal

import pytest

from workers.server import compute_semaphore
from workers.server.compute_semaphore import ComputeSemaphore, ComputeSemaphoreError

HANG_GUARD_S = 600


def _listed(semaphore_id: int) -> bool:
    return any(line.split()[1] == str(semaphore_id) for line in compute_semaphore.SEMAPHORES_TABLE.read_text().splitlines()[1:])


@pytest.fixture
def semaphore_file(tmp_path: pathlib.Path):
    """Create a semaphore of n units as the pool does: make(n) -> path; destroyed after the test."""
    made = []

    def make(units: int) -> str:
        path = str(tmp_path / f"compute-{len(made)}")
        made.append((path, compute_semaphore.create(path, units)))
        return path

    yield make
    for path, semaphore_id in made:
        compute_semaphore.destroy(path, semaphore_id)


def _hold(path: str, ready, release) -> None:
    with ComputeSemaphore(path):
        ready.set()
        if release is None:
            signal.pause()  # killed while holding its unit
        else:
            release.wait()  # no timeout of its own: a unit freed by one would pass for the waiter's (the test kills it)


@pytest.fixture
def holders():
    """Start a process that takes a unit and holds it: holder(path, killed=...) -> (process, ready, release); every
    one still running is killed after the test."""
    context = multiprocessing.get_context("fork")  # no resource tracker process left behind
    started = []

    def holder(path: str, *, killed: bool = False):
        ready, release = context.Event(), None if killed else context.Event()
        process = context.Process(target=_hold, args=(path, ready, release))
        process.start()
        started.append(process)
        return process, ready, release

    yield holder
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(HANG_GUARD_S)


def test_the_semaphore_bounds_the_workers_computing_and_a_dead_holders_unit_comes_back(semaphore_file, holders):
    path = semaphore_file(1)
    holder, holder_ready, _ = holders(path, killed=True)
    assert holder_ready.wait(HANG_GUARD_S)
    waiter, waiter_ready, release = holders(path)
    assert not waiter_ready.wait(0.5)  # the one unit is held
    os.kill(holder.pid, signal.SIGKILL)  # SEM_UNDO: the kernel gives its unit back
    holder.join(HANG_GUARD_S)
    assert waiter_ready.wait(HANG_GUARD_S)
    release.set()
    waiter.join(HANG_GUARD_S)
    assert waiter.exitcode == 0


@pytest.mark.parametrize("freed", [0, 1])
def test_a_waiter_takes_whichever_unit_frees_first(semaphore_file, holders, freed):
    """Two units, both held: the waiter goes on when either holder lets go (the file locks before stop 55 made it
    wait for one chosen in advance, even while the other stood free)."""
    path = semaphore_file(2)
    held = [holders(path) for _ in range(2)]
    for _, ready, _ in held:
        assert ready.wait(HANG_GUARD_S)
    waiter, waiter_ready, waiter_release = holders(path)
    assert not waiter_ready.wait(0.5)  # both units held: a third computes only when one frees
    process, _, release = held[freed]
    release.set()
    process.join(HANG_GUARD_S)
    assert waiter_ready.wait(HANG_GUARD_S)
    for _, _, release in [*held, (waiter, waiter_ready, waiter_release)]:
        release.set()
    waiter.join(HANG_GUARD_S)
    assert waiter.exitcode == 0


def test_a_semaphore_a_killed_daemon_left_is_removed_by_the_next_and_destroy_removes_its_own(tmp_path):
    path = str(tmp_path / "compute")
    left = compute_semaphore.create(path, 2)  # its daemon killed: never destroyed
    assert _listed(left)
    again = compute_semaphore.create(path, 2)
    assert not _listed(left) and _listed(again)
    assert pathlib.Path(path).read_text().split()[0] == str(again)
    compute_semaphore.destroy(path, again)
    assert not _listed(again) and not pathlib.Path(path).exists()
    with pytest.raises(FileNotFoundError):
        ComputeSemaphore(path)


def test_a_file_naming_another_semaphore_leaves_it_alone(tmp_path):
    """The file's recorded creator and ctime must match the kernel's: an id reused by another's semaphore since is not removed."""
    other_path, path = str(tmp_path / "other"), str(tmp_path / "compute")
    other = compute_semaphore.create(other_path, 1)
    try:
        pathlib.Path(path).write_text(f"{other} 0:1\n")  # the same id, another creation
        mine = compute_semaphore.create(path, 1)
        assert _listed(other)
        compute_semaphore.destroy(path, mine)
    finally:
        compute_semaphore.destroy(other_path, other)


def test_a_file_that_names_no_semaphore_is_a_typed_error_for_a_worker_and_replaced_by_the_pool(tmp_path):
    path = tmp_path / "compute"
    path.write_text("not an id\n")
    with pytest.raises(ComputeSemaphoreError):
        ComputeSemaphore(str(path))
    made = compute_semaphore.create(str(path), 1)
    with ComputeSemaphore(str(path)):
        pass
    compute_semaphore.destroy(str(path), made)


def test_a_worker_whose_semaphore_was_removed_gets_a_typed_error(tmp_path):
    path = str(tmp_path / "compute")
    semaphore_id = compute_semaphore.create(path, 1)
    semaphore = ComputeSemaphore(path)
    compute_semaphore.destroy(path, semaphore_id)
    with pytest.raises(ComputeSemaphoreError), semaphore:
        pass

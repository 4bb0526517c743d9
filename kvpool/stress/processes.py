"""Processes and shared-memory segments of the daemons under test: what they are, and whether any outlived them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import psutil

from kvpool.launcher import Daemon

SHARED_MEMORY_DIR = "/dev/shm"
SEGMENT_PREFIX = "psm_"  # multiprocessing.shared_memory's names
# The contract: every process of a daemon (its workers, multiprocessing's resource tracker) exits once its
# supervisor is gone, by any signal, and its /dev/shm segments are removed. A worker looks for its parent
# every 0.2 s (workers.server.main): all of a SIGKILLed supervisor's were gone 0.15-0.24 s after it on 2
# quiet cores. How long it took is reported; the limit on the wait is a hang guard, far above that on the
# slowest, busiest machine, never a verdict on its speed.
ORPHAN_HANG_GUARD_S = 300.0
PROGRESS_EVERY_S = 15.0
POLL_S = 0.02

Say = Callable[[str], None]


def say_on_stderr(message: str) -> None:
    print(f"kvpool stress: {message}", file=sys.stderr, flush=True)


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no memory, file or pipe)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (workers, multiprocessing's resource tracker)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def mapped_segments(processes: Iterable[psutil.Process]) -> set[str]:
    """The /dev/shm segments these processes have mapped (read from their memory maps)."""
    paths: set[str] = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            for mapping in process.memory_maps(grouped=True):
                path = mapping.path.removesuffix(" (deleted)")
                if path.startswith(f"{SHARED_MEMORY_DIR}/{SEGMENT_PREFIX}"):
                    paths.add(path)
    return paths


@dataclasses.dataclass(frozen=True, slots=True)
class Gone:
    """How a wait for processes to exit ended."""

    left_alive: list[psutil.Process]  # still alive at the hang guard (the caller kills them)
    seconds: float  # from `since` until the last was gone (or until the guard)


def wait_gone(processes: Sequence[psutil.Process], what: str, say: Say, *, since: float | None = None,
              hang_guard_s: float = ORPHAN_HANG_GUARD_S) -> Gone:
    """Poll until every process is gone (or a zombie), `since` a monotonic time (default: now); every
    PROGRESS_EVERY_S, `say` which of `what` are still alive. Gives up only at the hang guard."""
    started = time.monotonic() if since is None else since
    next_note = time.monotonic() + PROGRESS_EVERY_S
    remaining = [p for p in processes if alive(p)]
    while remaining and time.monotonic() - started < hang_guard_s:
        if time.monotonic() >= next_note:
            next_note += PROGRESS_EVERY_S
            say(f"waiting for {what} to exit ({time.monotonic() - started:.0f} s, hang guard {hang_guard_s:g} s): "
                f"still alive {[p.pid for p in remaining]}")
        time.sleep(POLL_S)
        remaining = [p for p in remaining if alive(p)]
    return Gone(remaining, round(time.monotonic() - started, 3))


def kill_all(processes: Iterable[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def existing(paths: Iterable[str]) -> list[str]:
    return sorted(path for path in paths if os.path.exists(path))


def unlink_all(paths: Iterable[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


@dataclasses.dataclass(slots=True)
class Footprint:
    """Every process and segment seen belonging to the daemons under test, to check after they stopped."""

    processes: dict[int, psutil.Process] = dataclasses.field(default_factory=dict)
    segments: set[str] = dataclasses.field(default_factory=set)

    def add(self, daemons: Iterable[Daemon]) -> None:
        for daemon in daemons:
            tree = process_tree(daemon.process.pid)
            self.segments |= mapped_segments(tree)
            for process in tree:
                self.processes.setdefault(process.pid, process)

    def leftovers(self, say: Say = say_on_stderr) -> tuple[list[int], list[str]]:
        """After the daemons stopped: processes still alive at the hang guard (then killed) and segments still
        in /dev/shm once they are gone (then unlinked), so that nothing outlives the run either way. Once every
        process is gone, so is whatever would have removed a segment (the resource tracker among them)."""
        gone = wait_gone(list(self.processes.values()), "the processes of the stopped daemons", say)
        kill_all(gone.left_alive)
        segments_left = existing(self.segments)
        unlink_all(segments_left)
        return [p.pid for p in gone.left_alive], segments_left

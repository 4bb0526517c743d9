"""Processes and shared-memory segments of the daemons under test: what they are, and whether any outlived them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Sequence

import psutil

from kvpool.launcher import Daemon

SHARED_MEMORY_DIR = "/dev/shm"
SEGMENT_PREFIX = "psm_"  # multiprocessing.shared_memory's names
# The contract: a daemon's workers exit within 5 s of their supervisor's death, by any signal.
ORPHAN_DEADLINE_S = 5.0
POLL_S = 0.02


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


def wait_gone(processes: Sequence[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those still alive after timeout_s (polled)."""
    deadline = time.monotonic() + timeout_s
    remaining = [p for p in processes if alive(p)]
    while remaining and time.monotonic() < deadline:
        time.sleep(POLL_S)
        remaining = [p for p in remaining if alive(p)]
    return remaining


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

    def leftovers(self) -> tuple[list[int], list[str]]:
        """After the daemons stopped: processes still alive after ORPHAN_DEADLINE_S (then killed) and
        segments still in /dev/shm (then unlinked), so that nothing outlives the run either way."""
        alive_after = wait_gone(list(self.processes.values()), ORPHAN_DEADLINE_S)
        kill_all(alive_after)
        segments_left = existing(self.segments)
        unlink_all(segments_left)
        return [p.pid for p in alive_after], segments_left

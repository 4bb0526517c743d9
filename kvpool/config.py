"""Configuration: the one place environment variables are read, and the daemon's settings object."""

from __future__ import annotations

import os
import pathlib

WORK_DIR_ENV = "KVPOOL_WORK_DIR"
DEFAULT_WORK_DIR = ".kvpool"


def work_dir() -> pathlib.Path:
    """Where generated shards, sockets and benchmark output go (git-ignored in the repository)."""
    return pathlib.Path(os.environ.get(WORK_DIR_ENV) or DEFAULT_WORK_DIR).resolve()


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)

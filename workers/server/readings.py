"""A process's memory as /proc reads it: the supervisor reads its workers' and a worker its own (no llama.cpp import)."""

from __future__ import annotations


def anonymous_bytes(pid: int | str = "self") -> int:
    """A process's anonymous memory (what contexts allocate; the mmap'd weights left out), from
    /proc/<pid>/smaps_rollup; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0

"""A process's memory as /proc reads it: the supervisor reads its workers' and a worker its own (no llama.cpp import)."""

from __future__ import annotations


def _rollup_bytes(pid: int | str, field: str) -> int:
    """One field of /proc/<pid>/smaps_rollup in bytes; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def anonymous_bytes(pid: int | str = "self") -> int:
    """A process's anonymous memory (what contexts allocate; the mmap'd weights left out)."""
    return _rollup_bytes(pid, "Anonymous:")


def huge_page_bytes(pid: int | str = "self") -> int:
    """A process's anonymous memory in transparent huge pages (AnonHugePages)."""
    return _rollup_bytes(pid, "AnonHugePages:")

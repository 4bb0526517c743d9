"""Room for the workers' segments in /dev/shm (their regions: workers.server.segment)."""

from __future__ import annotations

import os

from kvpool.host import format_bytes
from workers.server.segment import SegmentRegions

SHARED_MEMORY_DIR = "/dev/shm"


class SharedMemoryTooSmall(Exception):
    """/dev/shm has less free space than the workers' segments need."""


def free_shared_memory_bytes(directory: str = SHARED_MEMORY_DIR) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def check_room_for(segments: int, regions: SegmentRegions, *, directory: str = SHARED_MEMORY_DIR) -> None:
    """Refuse to start when `segments` segments of `regions` do not fit in the free space of `directory`."""
    needed = segments * regions.total_bytes
    free = free_shared_memory_bytes(directory)
    if needed > free:
        raise SharedMemoryTooSmall(
            f"{directory} has {format_bytes(free)} free but {segments} workers need {format_bytes(needed)} of shared "
            f"memory ({format_bytes(regions.total_bytes)} each); lower --max-sessions, --n-ctx or --max-request-bytes, "
            f"or give {directory} more room (docker run --shm-size)"
        )

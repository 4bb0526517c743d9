"""The supervisor-worker pipe in one process, for tests of workers.server.pipe and what crosses it."""

from __future__ import annotations

import multiprocessing
import os


def open_descriptors() -> set[tuple[str, str]]:
    """This process's descriptors and what each names. Compared as sets, after against before: a descriptor
    left open shows up as new; one another thread closes meanwhile (a test before this one winding down)
    changes nothing."""
    opened = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # closed since the listing (listdir's own descriptor among them)
    return opened


def pipe_pair():
    """(supervisor end, worker end), as the pool creates them."""
    return multiprocessing.get_context("spawn").Pipe(duplex=True)

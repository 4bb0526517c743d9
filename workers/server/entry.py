"""The worker process as its supervisor sees it from outside: the spawn target and a reading of a worker's
memory. Light on purpose: the supervisor imports this module, so it imports nothing of llama.cpp; the spawned
child imports workers.server.main, and with it the runtime and llama.cpp's bindings, when it starts."""

from __future__ import annotations

from multiprocessing.connection import Connection

from workers.server.spec import WorkerSpec


def worker_entry(connection: Connection, spec: WorkerSpec, cancel_connection: Connection | None = None) -> None:
    """What kvpool.daemon.pool.process spawns: workers.server.main.worker_main, imported in the child."""
    from workers.server.main import worker_main  # in the worker only (the module docstring)

    worker_main(connection, spec, cancel_connection)


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

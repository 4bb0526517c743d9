"""The worker process's spawn target. Light on purpose: the supervisor imports this module, so it imports nothing of llama.cpp; the spawned
child imports workers.server.main, and with it the runtime and llama.cpp's bindings, when it starts."""

from __future__ import annotations

from multiprocessing.connection import Connection

from workers.server.spec import WorkerSpec
from workers.server.spin import set_idle_spin


def worker_entry(connection: Connection, spec: WorkerSpec, cancel_connection: Connection | None = None) -> None:
    """What kvpool.daemon.pool.process spawns: workers.server.main.worker_main, imported in the child once
    the idle spin of llama.cpp's threads is set (libgomp reads it as llama.cpp loads)."""
    idle_spin = set_idle_spin(spec.idle_spin)
    from workers.server.main import worker_main  # in the worker only (the module docstring)

    worker_main(connection, spec, cancel_connection, idle_spin=idle_spin)

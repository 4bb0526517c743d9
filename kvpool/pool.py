"""The worker pool: spawned, named worker processes, started together, replaced one at a time.

The pool owns processes and their segments and nothing else: which worker is free or serves which
session is the books' business (kvpool.books).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from kvpool.integrity import require
from kvpool.worker_handle import PoolSpec, WorkerHandle
from workers.commands import Ready


class WorkerPool:
    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._counter = 0
        self._workers: dict[str, WorkerHandle] = {}
        self._lock = threading.Lock()

    def start(self) -> Ready:
        """Spawn every worker in parallel and wait for all to be ready; on failure stop them all."""
        handles = [self._spawn() for _ in range(self.spec.size)]
        try:
            with ThreadPoolExecutor(max_workers=len(handles)) as executor:
                readies = list(executor.map(lambda h: h.wait_ready(self.spec.ready_timeout_s), handles))
        except BaseException:
            for handle in handles:
                handle.stop(timeout_s=1.0)
            raise
        with self._lock:
            for handle in handles:
                self._workers[handle.name] = handle
        return readies[0]

    def _next_number(self) -> int:
        """Unique for the pool's life, also when replacements start in several threads at once."""
        with self._lock:
            self._counter += 1
            return self._counter

    def _spawn(self) -> WorkerHandle:
        number = self._next_number()
        return WorkerHandle(f"kvpool-worker-{number}", self.spec, number)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._workers)

    def workers(self) -> list[WorkerHandle]:
        with self._lock:
            return list(self._workers.values())

    def get(self, name: str) -> WorkerHandle:
        return self._workers[name]

    def usable(self, name: str) -> bool:
        """The worker can be lent: its process is alive and was never lost."""
        handle = self._workers.get(name)
        return handle is not None and not handle.lost and not handle.exited

    @property
    def segment_bytes(self) -> int:
        """Shared memory held by the workers' segments (fixed per worker; outside the session budget)."""
        with self._lock:
            return sum(handle.segment_bytes for handle in self._workers.values())

    def start_replacement(self, name: str) -> WorkerHandle:
        """Stop a worker (lost, or drifted in memory) and start a fresh one, ready. Blocking; the pool itself
        does not change until swap(), which the caller makes together with its books."""
        self._workers[name].stop(timeout_s=1.0)
        fresh = self._spawn()
        try:
            fresh.wait_ready(self.spec.ready_timeout_s)
        except BaseException:
            fresh.stop(timeout_s=1.0)
            raise
        return fresh

    def swap(self, name: str, fresh: WorkerHandle | None) -> None:
        """The stopped worker `name` leaves the pool; `fresh` (if any) takes its place."""
        with self._lock:
            self._workers.pop(name, None)
            if fresh is not None:
                self._workers[fresh.name] = fresh

    def check_integrity(self) -> None:
        expected = self.spec.segment.total_bytes
        wrong = sorted(h.name for h in self.workers() if h.segment_bytes != expected)
        require(not wrong, f"workers whose segment is not {expected} bytes: {wrong}")

    def close(self) -> None:
        with self._lock:
            handles = list(self._workers.values())
            self._workers.clear()
        for handle in reversed(handles):
            handle.stop()

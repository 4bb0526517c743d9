"""The worker pool: spawned, named worker processes, started together, replaced one at a time.

The pool owns processes and their segments and nothing else: which worker is free or serves which
session is the books' business (kvpool.daemon.books.books). What it lends are workers: a worker process each in
process mode; in batched mode each sequence slot of a batched process (kvpool.daemon.pool.batched), the
slots of one process lent separately and replaced together (a fresh process's other slots wait as
spares for the dead one's other slots).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

from kvpool.daemon.books.integrity import require
from kvpool.daemon.pool.batched import BatchedWorker, SequenceSlot
from kvpool.daemon.pool.compute import ComputeSlots
from kvpool.daemon.pool.handle import PoolSpec, WorkerHandle
from workers.server import compute_semaphore
from workers.server.commands import Ready

Lendable = WorkerHandle | SequenceSlot


class WorkerPool:
    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._counter = 0
        self._workers: dict[str, Lendable] = {}
        self._spares: dict[int, list[SequenceSlot]] = {}  # a dead batched process (id) -> its successor's unlent slots
        self._lock = threading.Lock()
        self._replace_lock = threading.Lock()
        self._compute_semaphore: compute_semaphore.Created | None = None  # while the pool has created it
        self.compute: ComputeSlots | None = None  # batched mode: the daemon's compute slots, one per batch (set by the service)

    @property
    def batched(self) -> bool:
        return self.spec.worker.seqs_per_worker > 0

    def start(self) -> Ready:
        """Spawn every worker in parallel and wait for all to be ready; on failure stop them all."""
        handles: list[WorkerHandle] = []
        try:
            self._create_compute_semaphore()
            processes = -(-self.spec.size // self.spec.worker.seqs_per_worker) if self.batched else self.spec.size
            handles.extend(self._spawn() for _ in range(processes))
            with ThreadPoolExecutor(max_workers=len(handles)) as executor:
                readies = list(executor.map(lambda h: h.wait_ready(self.spec.ready_timeout_s), handles))
        except BaseException:
            for handle in handles:
                handle.stop(timeout_s=1.0)
            self._destroy_compute_semaphore()
            raise
        with self._lock:
            for handle in handles:
                for lendable in self._lendables(handle):
                    self._workers[lendable.name] = lendable
        return readies[0]

    @staticmethod
    def _lendables(handle: WorkerHandle) -> list[Lendable]:
        return list(handle.slots) if isinstance(handle, BatchedWorker) else [handle]

    def _create_compute_semaphore(self) -> None:
        """The semaphore that bounds the workers computing at once (workers.server.compute_semaphore), its id in
        the spec every worker is spawned with; with no bound, what dead daemons on the socket left is cleared all the same."""
        record = self.spec.compute_records
        if self.spec.compute_slots:
            require(bool(record), "a compute bound needs PoolSpec.compute_records")
            self._compute_semaphore = compute_semaphore.create(record, self.spec.compute_slots)
            worker = dataclasses.replace(self.spec.worker, compute_semaphore=self._compute_semaphore.id)
            self.spec = dataclasses.replace(self.spec, worker=worker)
        elif record:
            compute_semaphore.clear_left_behind(record)

    def _destroy_compute_semaphore(self) -> None:
        if self._compute_semaphore is not None:
            compute_semaphore.destroy(self._compute_semaphore)
            self._compute_semaphore = None

    def _next_number(self) -> int:
        """Unique for the pool's life, also when replacements start in several threads at once."""
        with self._lock:
            self._counter += 1
            return self._counter

    def _spawn(self) -> WorkerHandle:
        number = self._next_number()
        single, batched = self.spec.kinds or (WorkerHandle, BatchedWorker)
        if self.batched:
            return batched(f"kvpool-worker-{number}", self.spec, number, compute=self.compute)
        return single(f"kvpool-worker-{number}", self.spec, number)

    def use_compute_slots(self, compute: ComputeSlots) -> None:
        self.compute = compute
        for process in self.processes():
            if isinstance(process, BatchedWorker):
                process.compute = compute

    def append_slot(self):
        """What an append holds around its worker call: a compute slot, or, for a batched worker, nothing
        (its batch takes one)."""
        assert self.compute is not None, "use_compute_slots first"
        return contextlib.nullcontext() if self.batched else self.compute.slot()

    def shared_context(self) -> tuple[int, int] | None:
        """Batched mode: (bytes of one process's context of every sequence, sequences per process)."""
        if not self.batched:
            return None
        measured = [process.ready.context_bytes for process in self.processes() if process.ready is not None]
        return (max(measured, default=0), self.spec.worker.seqs_per_worker)

    def batch_counts(self) -> dict[str, int]:
        """Batched mode: RunBatch calls and the appends they carried, over the live processes."""
        processes = [process for process in self.processes() if isinstance(process, BatchedWorker)]
        if not processes:
            return {}
        return {"batches": sum(p.batches for p in processes), "batched_appends": sum(p.batched_items for p in processes)}

    def names(self) -> list[str]:
        with self._lock:
            return list(self._workers)

    def workers(self) -> list[Lendable]:
        with self._lock:
            return list(self._workers.values())

    def processes(self) -> list[WorkerHandle]:
        """Each worker process once (a batched one stands for all its slots)."""
        seen: dict[int, WorkerHandle] = {}
        for lendable in self.workers():
            process = lendable.process if isinstance(lendable, SequenceSlot) else lendable
            seen.setdefault(id(process), process)
        return list(seen.values())

    def get(self, name: str) -> Lendable:
        return self._workers[name]

    def usable(self, name: str) -> bool:
        """The worker can be lent: its process is alive and was never lost."""
        handle = self._workers.get(name)
        return handle is not None and not handle.lost and not handle.exited

    @property
    def segment_bytes(self) -> int:
        """Shared memory held by the workers' segments (fixed per worker; outside the session budget)."""
        return sum(process.segment_bytes for process in self.processes())

    def start_replacement(self, name: str) -> Lendable:
        """Stop a worker (lost, or drifted in memory) and start a fresh one, ready. Blocking; the pool itself
        does not change until swap(), which the caller makes together with its books. A batched slot's
        replacement is a slot of the process that replaced its process (started by the first of them)."""
        old = self._workers[name]
        if not isinstance(old, SequenceSlot):
            old.stop(timeout_s=1.0)
            return self._started()
        with self._replace_lock:
            spares = self._spares.get(id(old.process))
            if spares:
                return spares.pop()
            old.process.stop(timeout_s=1.0)
            fresh = self._started()
            assert isinstance(fresh, BatchedWorker)
            self._spares[id(old.process)] = list(reversed(fresh.slots[1:]))
            return fresh.slots[0]

    def _started(self) -> WorkerHandle:
        fresh = self._spawn()
        try:
            fresh.wait_ready(self.spec.ready_timeout_s)
        except BaseException:
            fresh.stop(timeout_s=1.0)
            raise
        return fresh

    def swap(self, name: str, fresh: Lendable | None) -> None:
        """The stopped worker `name` leaves the pool; `fresh` (if any) takes its place."""
        with self._lock:
            self._workers.pop(name, None)
            if fresh is not None:
                self._workers[fresh.name] = fresh

    def check_integrity(self) -> None:
        expected = self.spec.worker.segment.total_bytes
        wrong = sorted(h.name for h in self.processes() if h.segment_bytes != expected)
        require(not wrong, f"workers whose segment is not {expected} bytes: {wrong}")

    def close(self) -> None:
        handles = self.processes() + [slot.process for spares in self._spares.values() for slot in spares[:1]]
        with self._lock:
            self._workers.clear()
            self._spares.clear()
        try:
            for handle in reversed(handles):
                handle.stop()
        finally:
            self._destroy_compute_semaphore()

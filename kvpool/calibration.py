"""What a session of n_ctx positions is charged: measured once per n_ctx on a free worker (a context
created, one full batch run through it, the worker's USS growth read, the context freed), never less
than the theoretical KV cache. The same context then times a few one-row appends: the shard's decode
step (`step_s`, the median), from which the default residency is derived (kvpool.residency)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvpool.books import Books
from kvpool.compute import ComputeSlots
from kvpool.pool import WorkerPool
from kvpool.protocol import ShardDescription
from kvpool.worker_lifecycle import WorkerLifecycle

CALIBRATION_ROWS = 512
STEP_SAMPLES = 3


class Calibrator:
    def __init__(self, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, compute: ComputeSlots, shard: ShardDescription, kv_bytes_per_position: int) -> None:
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.compute = compute
        self.shard = shard
        self.kv_bytes_per_position = kv_bytes_per_position
        self._charge_by_n_ctx: dict[int, int] = {}
        self.step_s: float | None = None  # one decode step of this shard, measured with the first charge

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    async def charge_for(self, n_ctx: int) -> int:
        charge = self._charge_by_n_ctx.get(n_ctx)
        if charge is not None:
            return charge
        worker = self.books.take(self.pool.usable)
        if worker is None:
            # No free worker to measure on: scale a measured size by the KV difference.
            known_n_ctx, known = next(iter(self._charge_by_n_ctx.items()))
            return known + self.theoretical_kv_bytes(n_ctx) - self.theoretical_kv_bytes(known_n_ctx)
        try:
            charge = await self._measure(worker, n_ctx)
        finally:
            await self.lifecycle.free(worker)
        self._charge_by_n_ctx[n_ctx] = charge
        return charge

    async def _measure(self, name: str, n_ctx: int) -> int:
        worker = self.pool.get(name)
        before = await self.lifecycle.in_thread(worker.measure_uss)
        worker.set_abort(False)  # a late cancel of this worker's previous session must not abort this
        await worker.open(n_ctx)
        rows = min(CALIBRATION_ROWS, n_ctx)
        shape = self.shard.shape
        batch = np.zeros(rows, np.int32) if shape.is_first else np.zeros((rows, shape.n_embd), np.float32)
        async with self.compute.slot():
            await worker.append(0, batch)
        after = await self.lifecycle.in_thread(worker.measure_uss)
        if self.step_s is None:
            self.step_s = await self._time_steps(worker, rows, batch[:1])
        return max(after - before, self.theoretical_kv_bytes(n_ctx))

    async def _time_steps(self, worker, rows: int, row: np.ndarray) -> float:
        """The median of STEP_SAMPLES one-row appends at the end of the calibration batch."""
        samples = []
        for _ in range(STEP_SAMPLES):
            await worker.truncate(rows - 1)
            async with self.compute.slot():
                started = time.perf_counter()
                await worker.append(rows - 1, row)
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)

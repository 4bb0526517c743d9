"""What a session of n_ctx positions is charged, known before its first admission: no admission waits for
a measurement.

At start-up `calibrate` measures two sizes on free workers: the daemon's largest n_ctx N and a small one
(SMALL_N_CTX). A measurement creates a context, fills it (batches of min(512, n_ctx) rows up to n_ctx: the
compute buffers' pages are touched as the attention grows), reads the growth of the worker's anonymous
memory (the mmap'd weights left out) and frees the context.

The fit, `ChargeFit`: a context of n positions holds its KV cache, which grows with n (the theoretical KV
per position, f16 K and V; llama.cpp may round n up), plus compute buffers, which grow with the batch,
min(512, n) rows, and with the attention's length, n. Both grow with n, at least b per position (b the
theoretical KV per position), so a size measured at m bytes bounds every smaller n:
charge(n) <= m - b x (size - n).
A straight line through the two measured points would not do: below 512 positions the batch shrinks with
n, so the measured slope overstates b and the line falls under the true cost between the two sizes
(middle shard of the bundled model, measured at 64, 512 and 2048 positions: 6.1, 30.2 and 43.9 MiB; the
line through the ends gives 14.4 MiB at 512). The charge is the tightest such bound from a measured size at or
above n (never below a measured smaller size), each measurement first raised by a margin for noise;
rounded up, and never below the theoretical KV.

The first measurement also times a few one-row appends at the end of its batch: the shard's decode step
(`step_s`, the median), from which the default residency is derived (kvpool.daemon.admission.residency).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from kvpool.daemon.books.books import Books
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.wire.protocol import CalibrationRow, ShardDescription
from kvpool.daemon.pool.lifecycle import WorkerLifecycle

CALIBRATION_ROWS = 512
STEP_SAMPLES = 3
SMALL_N_CTX = 64  # the second size: 64 rows add ~12% to the start-up measurement of 512 rows
LLAMA_CTX_PAD = 256  # llama.cpp (0.3.36) rounds n_ctx up to this; the bound holds with or without it
MARGIN_BYTES = 1 << 20
MARGIN_DIVISOR = 16  # + 1/16 of each measurement: differences between workers and readings measured < 2%
ROUND_BYTES = 1 << 16


def _padded(n_ctx: int) -> int:
    return -(-n_ctx // LLAMA_CTX_PAD) * LLAMA_CTX_PAD


def _positions_between(small: int, large: int) -> int:
    """Cache positions a context of `large` surely holds beyond one of `small`, padded by llama.cpp or not."""
    return min(large - small, _padded(large) - _padded(small))


@dataclasses.dataclass(frozen=True, slots=True)
class ChargeFit:
    """charge(n) from measured (n_ctx, bytes) pairs and the theoretical KV bytes per position."""

    kv_bytes_per_position: int
    measured: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.measured or any(n_ctx < 1 or size < 0 for n_ctx, size in self.measured):
            raise ValueError(f"a fit needs measured sizes, got {self.measured}")
        object.__setattr__(self, "measured", tuple(sorted(self.measured)))

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    def bound(self, n_ctx: int) -> int:
        """The fitted cost of a context of n_ctx positions, the margin included."""
        per_position = self.kv_bytes_per_position
        raised = [(n, size + size // MARGIN_DIVISOR + MARGIN_BYTES) for n, size in self.measured]
        above = [size - per_position * _positions_between(n_ctx, n) for n, size in raised if n >= n_ctx]
        below = [size for n, size in raised if n <= n_ctx]
        if above:
            return max(min(above), *below) if below else min(above)
        # Beyond the largest measured size (the daemon admits none): grow at the steeper of the theoretical
        # KV and the slope between the measured ends, which overstates it.
        (small, small_size), (large, large_size) = raised[0], raised[-1]
        slope = max(per_position, -(-(large_size - small_size) // (large - small))) if large > small else per_position
        return large_size + slope * max(n_ctx - large, _padded(n_ctx) - _padded(large))

    def charge(self, n_ctx: int) -> int:
        if n_ctx < 1:
            raise ValueError("n_ctx must be at least 1")
        charge = max(self.bound(n_ctx), self.theoretical_kv_bytes(n_ctx))
        return -(-charge // ROUND_BYTES) * ROUND_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class SharedContextCharge:
    """Batched mode: every session is one sequence of a context made for `n_seqs` sequences of n_ctx_max
    positions each, allocated whole when its worker starts. A session is charged its share of the
    context as measured (its creation, then the growth of a first batch), the margin included, whatever
    n_ctx it asks for: its sequence holds n_ctx_max positions anyway."""

    kv_bytes_per_position: int
    measured: tuple[tuple[int, int], ...]  # ((n_ctx_max, the whole context's bytes),)
    n_seqs: int

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    def charge(self, n_ctx: int) -> int:
        if n_ctx < 1:
            raise ValueError("n_ctx must be at least 1")
        (n_ctx_max, size), = self.measured
        raised = size + size // MARGIN_DIVISOR + MARGIN_BYTES
        share = max(-(-raised // self.n_seqs), self.theoretical_kv_bytes(n_ctx_max))
        return -(-share // ROUND_BYTES) * ROUND_BYTES


class Calibrator:
    def __init__(
        self, books: Books, pool: WorkerPool, lifecycle: WorkerLifecycle, metrics: Metrics,
        shard: ShardDescription, kv_bytes_per_position: int, *, shared_context: tuple[int, int] | None = None,
    ) -> None:
        self.shared_context = shared_context  # batched mode: (one process's context bytes, sequences in it)
        self.books = books
        self.pool = pool
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.shard = shard
        self.kv_bytes_per_position = kv_bytes_per_position
        self.fit: ChargeFit | SharedContextCharge | None = None
        self.step_s: float | None = None  # one decode step of this shard, measured with the first size

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    def charge_for(self, n_ctx: int) -> int:
        """What a session of n_ctx is charged; never measures."""
        if self.fit is None:
            raise RuntimeError("the daemon has not calibrated yet")
        return self.fit.charge(n_ctx)

    def rows(self) -> list[CalibrationRow]:
        """The start-up measurements and what each size is charged (for stats)."""
        fit = self.fit
        if fit is None:
            return []
        return [
            CalibrationRow(n_ctx=n, measured_bytes=size, charged_bytes=fit.charge(n), theoretical_kv_bytes=fit.theoretical_kv_bytes(n))
            for n, size in fit.measured
        ]

    async def calibrate(self, largest_n_ctx: int) -> ChargeFit | SharedContextCharge:
        """Measure largest_n_ctx and SMALL_N_CTX (when smaller), each on a fresh worker when there are enough.
        Batched mode: one batch on one sequence, its growth added to the context measured at start-up."""
        if self.shared_context is not None:
            return await self._calibrate_shared(largest_n_ctx, *self.shared_context)
        sizes = [largest_n_ctx] + ([SMALL_N_CTX] if SMALL_N_CTX < largest_n_ctx else [])
        taken: list[str] = []
        try:
            for _ in sizes:
                worker = self.books.take(self.pool.usable)
                if worker is None:
                    break
                taken.append(worker)
            if not taken:
                raise RuntimeError("no usable worker to calibrate on")
            measured = []
            for index, n_ctx in enumerate(sizes):
                worker = taken[index % len(taken)]
                measured.append((n_ctx, await self._measure(worker, n_ctx)))
                await self.pool.get(worker).close_context()  # freed before the worker's next reading
        finally:
            for worker in taken:
                await self.lifecycle.free(worker)
        self.fit = ChargeFit(self.kv_bytes_per_position, tuple(measured))
        return self.fit

    async def _calibrate_shared(self, n_ctx_max: int, context_bytes: int, n_seqs: int) -> SharedContextCharge:
        worker = self.books.take(self.pool.usable)
        if worker is None:
            raise RuntimeError("no usable worker to calibrate on")
        try:
            growth = await self._measure(worker, n_ctx_max)
            await self.pool.get(worker).close_context()
        finally:
            await self.lifecycle.free(worker)
        self.fit = SharedContextCharge(self.kv_bytes_per_position, ((n_ctx_max, context_bytes + growth),), n_seqs)
        return self.fit

    async def _measure(self, name: str, n_ctx: int) -> int:
        worker = self.pool.get(name)
        before = await self.lifecycle.in_thread(worker.measure_anonymous)
        worker.set_abort(False)  # a late cancel of this worker's previous session must not abort this
        await worker.open(n_ctx)
        rows = min(CALIBRATION_ROWS, n_ctx)
        shape = self.shard.shape
        batch = np.zeros(rows, np.int32) if shape.is_first else np.zeros((rows, shape.n_embd), np.float32)
        # Filled to n_ctx: llama.cpp reserves its compute buffers for the longest attention at creation, but
        # their pages are touched as the cache fills (middle shard, n_ctx 2048: 44 MiB after one 512-row
        # batch, 90 MiB full), and a session may fill its context.
        for start in range(0, n_ctx, rows):
            async with self.pool.append_slot():
                await worker.append(start, batch[: min(rows, n_ctx - start)])
        after = await self.lifecycle.in_thread(worker.measure_anonymous)
        self.metrics.count("calibrations")
        if self.step_s is None:
            self.step_s = await self._time_steps(worker, rows, batch[:1])
        return max(after - before, 0)

    async def _time_steps(self, worker, rows: int, row: np.ndarray) -> float:
        """The median of STEP_SAMPLES one-row appends at the end of the first calibration batch."""
        samples = []
        for _ in range(STEP_SAMPLES):
            await worker.truncate(rows - 1)
            async with self.pool.append_slot():
                started = time.perf_counter()
                await worker.append(rows - 1, row)
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)

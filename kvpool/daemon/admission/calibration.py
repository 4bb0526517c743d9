"""What a session of n_ctx positions is charged, known before its first admission: no admission waits for
a measurement, and start-up does not fill a context of the daemon's --n-ctx.

At start-up `calibrate` probes one free worker: it creates a context of the daemon's largest n_ctx N, then
appends batches of min(512, N) rows up to min(N, PROBE_CELLS) cells, reading the growth of the worker's
anonymous memory (the mmap'd weights left out) after each. llama.cpp allocates and clears the whole KV cache
at creation, so every reading holds it; the compute buffers are reserved for the longest attention at
creation too, but their pages are touched only as the cache fills (middle shard of the bundled model,
n_ctx 4096, beyond the KV cache: +32 MiB after one 512-row batch, +130 MiB full). The probe's cost is a
fill of PROBE_CELLS cells whatever N is: it does not grow with --n-ctx.

Beyond the probed cells the growth is linear in the cells the attention reads (its score matrices and
their conversions are batch x cells x heads; measured on the three bundled shards, 512-row steps from
2048 to 4096 cells: 13.5 MiB each on the middle shard, 14.5 first, 14.5-15.0 last; with flash attention
none from 1536 on), so a reading at n cells is extrapolated at the growth of the probe's last batch, per
cell, over llama.cpp's padded cell count.

`ChargeFit`: a full context of n positions costs the probe's reading at n cells (the first fill that
reached n: a session of fewer than 512 positions computes smaller batches, and the 512-cell reading bounds
it), less the KV cache of the positions the probed context holds beyond n. The charge is that cost raised
by a margin for noise and rounded up, never below the theoretical KV. Batched mode
(`SharedContextCharge`): the context of every sequence is allocated when its worker starts; a session is
charged its share of that context plus the probe's reading at n_ctx_max (one sequence filled).

The probe also times a few one-row appends at the end of its first batch: the shard's decode step
(`step_s`, the median), from which the default residency is derived (kvpool.daemon.admission.residency).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from kvpool.daemon.admission.probe_cache import ProbeCache
from kvpool.daemon.books.books import Books
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.wire.protocol import CalibrationRow, ShardDescription

CALIBRATION_ROWS = 512
PROBE_CELLS = 2048  # four 512-row batches: the last growth is the per-cell slope (at 1536 it still overstates flash attention's)
STEP_SAMPLES = 3
PROBE_PARAMETERS = f"rows {CALIBRATION_ROWS}, cells {PROBE_CELLS}, steps {STEP_SAMPLES}"  # a ProbeCache key's: another probe, another key
LLAMA_CTX_PAD = 256  # llama.cpp (0.3.36) rounds n_ctx up to this, and the cells its attention reads
MARGIN_BYTES = 1 << 20
MARGIN_DIVISOR = 16  # + 1/16 of each cost: differences between workers and readings measured < 2%
ROUND_BYTES = 1 << 16


def _padded(n_ctx: int) -> int:
    return -(-n_ctx // LLAMA_CTX_PAD) * LLAMA_CTX_PAD


def _raised(size: int) -> int:
    return size + size // MARGIN_DIVISOR + MARGIN_BYTES


def _rounded(size: int) -> int:
    return -(-size // ROUND_BYTES) * ROUND_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """What the start-up probe read on one context of n_ctx positions: after each batch, (cells filled,
    the worker's growth since before the context was made), in filling order. Every reading holds the
    whole KV cache of n_ctx positions: llama.cpp allocates and clears it at creation."""

    n_ctx: int
    filled: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        cells = [cell for cell, _ in self.filled]
        if self.n_ctx < 1 or not cells or cells != sorted(set(cells)) or cells[-1] > self.n_ctx:
            raise ValueError(f"a probe needs increasing fills within its context, got {self.filled} of {self.n_ctx}")
        object.__setattr__(self, "filled", tuple((cell, max(size, 0)) for cell, size in self.filled))

    def extrapolated(self, n_ctx: int) -> bool:
        return n_ctx > self.filled[-1][0]

    def reading(self, cells: int) -> int:
        """The growth of the probed context with `cells` cells full: read at the first fill that reached
        them, else extrapolated at the last batch's growth per cell (never less than the last reading)."""
        for filled, size in self.filled:
            if filled >= cells:
                return size
        last_cells, last_size = self.filled[-1]
        if len(self.filled) < 2:
            return last_size
        before_cells, before_size = self.filled[-2]
        slope = max(last_size - before_size, 0) / (last_cells - before_cells)
        return last_size + int(-(-slope * (_padded(cells) - last_cells) // 1))


@dataclasses.dataclass(frozen=True, slots=True)
class ChargeFit:
    """charge(n) from the start-up probe and the theoretical KV bytes per position."""

    kv_bytes_per_position: int
    probe: Probe

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    def cost(self, n_ctx: int) -> int:
        """What a context of n_ctx positions takes when full, by the probe (no margin): its reading at
        n_ctx cells, less the KV cache of the positions the probed context holds beyond n_ctx."""
        probed = self.probe.n_ctx
        beyond = max(min(probed - n_ctx, _padded(probed) - _padded(n_ctx)), 0)  # padded by llama.cpp or not
        return max(self.probe.reading(n_ctx) - self.kv_bytes_per_position * beyond, 0)

    def charge(self, n_ctx: int) -> int:
        if n_ctx < 1:
            raise ValueError("n_ctx must be at least 1")
        return _rounded(max(_raised(self.cost(n_ctx)), self.theoretical_kv_bytes(n_ctx)))

    def sizes(self) -> list[int]:
        """The sizes stats report: each fill the probe read and the probed context's own n_ctx."""
        return sorted({cells for cells, _ in self.probe.filled} | {self.probe.n_ctx})


@dataclasses.dataclass(frozen=True, slots=True)
class SharedContextCharge:
    """Batched mode: every session is one sequence of a context made for `n_seqs` sequences of n_ctx_max
    positions each, allocated whole when its worker starts (`context_bytes`). A session is charged its
    share of that context plus the bytes the probe's sequence touches at n_ctx_max, the margin included,
    whatever n_ctx it asks for: its sequence holds n_ctx_max positions anyway."""

    kv_bytes_per_position: int
    context_bytes: int
    probe: Probe  # one sequence of the shared context, filled
    n_seqs: int

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    def cost(self, n_ctx: int) -> int:
        """The whole shared context's bytes with its compute buffers touched as at n_ctx_max (no margin)."""
        return self.context_bytes + self.probe.reading(self.probe.n_ctx)

    def charge(self, n_ctx: int) -> int:
        if n_ctx < 1:
            raise ValueError("n_ctx must be at least 1")
        share = max(-(-_raised(self.cost(n_ctx)) // self.n_seqs), self.theoretical_kv_bytes(self.probe.n_ctx))
        return _rounded(share)

    def sizes(self) -> list[int]:
        return [self.probe.n_ctx]


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
        self.step_s: float | None = None  # one decode step of this shard, timed after the probe's first batch
        self.cached_at: float | None = None  # the readings were kept from a probe at this wall-clock time (kvpool.daemon.admission.probe_cache)

    def theoretical_kv_bytes(self, n_ctx: int) -> int:
        return n_ctx * self.kv_bytes_per_position

    def charge_for(self, n_ctx: int) -> int:
        """What a session of n_ctx is charged; never measures."""
        if self.fit is None:
            raise RuntimeError("the daemon has not calibrated yet")
        return self.fit.charge(n_ctx)

    def rows(self) -> list[CalibrationRow]:
        """What the probe read, and what each of its sizes is charged (for stats)."""
        fit = self.fit
        if fit is None:
            return []
        return [
            CalibrationRow(
                n_ctx=n, measured_bytes=fit.cost(n), charged_bytes=fit.charge(n),
                theoretical_kv_bytes=fit.theoretical_kv_bytes(n), extrapolated=fit.probe.extrapolated(n),
            )
            for n in fit.sizes()
        ]

    async def calibrate(self, largest_n_ctx: int, cache: ProbeCache | None = None) -> ChargeFit | SharedContextCharge:
        """Probe a context of largest_n_ctx on one free worker (batched mode: one sequence of its shared
        context), then free it; with `cache`, take the readings kept there for this key instead (`cached_at`
        says when they were measured) or keep the new ones there."""
        cached = cache.load() if cache is not None else None
        if cached is not None and cached.n_ctx == largest_n_ctx:
            probe = Probe(cached.n_ctx, cached.filled)
            self.step_s = cached.step_s
            self.cached_at = cached.measured_at
            self.metrics.count("calibrations_cached")
        else:
            probe = await self._measured(largest_n_ctx)
            if cache is not None and not cache.store(probe.n_ctx, probe.filled, self.step_s):
                self.metrics.count("calibration_cache_failures")
        if self.shared_context is not None:
            context_bytes, n_seqs = self.shared_context
            self.fit = SharedContextCharge(self.kv_bytes_per_position, context_bytes, probe, n_seqs)
        else:
            self.fit = ChargeFit(self.kv_bytes_per_position, probe)
        return self.fit

    async def _measured(self, n_ctx: int) -> Probe:
        worker = self.books.take(self.pool.usable)
        if worker is None:
            raise RuntimeError("no usable worker to calibrate on")
        try:
            await self.pool.get(worker).close_context()  # a spare it kept would be taken by the probe's open
            probe = await self._probe(worker, n_ctx)
            await self.pool.get(worker).close_context()
        finally:
            await self.lifecycle.free(worker)
        return probe
    async def _probe(self, name: str, n_ctx: int) -> Probe:
        worker = self.pool.get(name)
        before = await self.lifecycle.in_thread(worker.measure_anonymous)
        worker.set_abort(False)  # a late cancel of this worker's previous session must not abort this
        await worker.open(n_ctx)
        rows = min(CALIBRATION_ROWS, n_ctx)
        shape = self.shard.shape
        batch = np.zeros(rows, np.int32) if shape.is_first else np.zeros((rows, shape.n_embd), np.float32)
        filled = []
        for start in range(0, min(n_ctx, PROBE_CELLS), rows):
            count = min(rows, n_ctx - start)
            async with self.pool.append_slot():
                await worker.append(start, batch[:count])
            filled.append((start + count, await self.lifecycle.in_thread(worker.measure_anonymous) - before))
            if self.step_s is None:
                self.step_s = await self._time_steps(worker, count, batch[:1])
        self.metrics.count("calibrations")
        return Probe(n_ctx, tuple(filled))

    async def _time_steps(self, worker, rows: int, row: np.ndarray) -> float:
        """The median of STEP_SAMPLES one-row appends at the end of the first probe batch (which it leaves
        as it found it: `rows` cells)."""
        samples = []
        for _ in range(STEP_SAMPLES):
            await worker.truncate(rows - 1)
            async with self.pool.append_slot():
                started = time.perf_counter()
                await worker.append(rows - 1, row)
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)

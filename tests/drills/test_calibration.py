"""The charge fit: every n_ctx up to the daemon's largest is charged at least what a full context costs,
and not much more, from one probe at start-up that fills at most PROBE_CELLS cells (pure), and daemons end
to end: a full context within its charge, and the charge within 15% of what a full context really takes,
in both modes (more in test_daemon.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.daemon.admission.calibration import (
    CALIBRATION_ROWS,
    LLAMA_CTX_PAD,
    MARGIN_BYTES,
    PROBE_CELLS,
    ROUND_BYTES,
    ChargeFit,
    Probe,
    SharedContextCharge,
)
from tests.support.daemons import DaemonProcess
from workers.server.main import MMAP_THRESHOLD_BYTES
from workers.server.readings import anonymous_bytes

MIB = 1 << 20
CONVERSE_FACTOR = 1.15  # the charge is at most this much of a full context's real cost ...
CONVERSE_BYTES = 2 * MIB  # ... plus this


def _padded(n: int) -> int:
    return -(-n // LLAMA_CTX_PAD) * LLAMA_CTX_PAD


def test_a_probe_reads_where_it_filled_and_extrapolates_at_its_last_growth_per_cell() -> None:
    probe = Probe(4096, ((512, 40 * MIB), (1024, 56 * MIB), (1536, 70 * MIB), (2048, 83 * MIB)))
    assert [probe.reading(n) for n in (1, 512, 513, 1024, 2048)] == [40 * MIB, 40 * MIB, 56 * MIB, 56 * MIB, 83 * MIB]
    assert probe.reading(4096) == 83 * MIB + 4 * 13 * MIB  # 13 MiB per 512 cells, the last batch's growth
    assert probe.reading(2049) == 83 * MIB + 13 * MIB // 2  # llama.cpp pads the cells to 256
    assert not probe.extrapolated(2048) and probe.extrapolated(2049)
    shrinking = Probe(4096, ((1536, 70 * MIB), (2048, 69 * MIB)))
    assert shrinking.reading(4096) == 69 * MIB  # never below the last reading
    for bad in (((),), (((1024, 1), (512, 2)),), (((512, 1), (512, 2)),), (((8192, 1),),)):
        with pytest.raises(ValueError):
            Probe(4096, *bad)


def test_charges_are_rounded_never_below_theory_and_grow_with_n_ctx() -> None:
    fit = ChargeFit(1000, Probe(2048, ((512, 10 * MIB), (1024, 14 * MIB), (1536, 17 * MIB), (2048, 20 * MIB))))
    charges = [fit.charge(n_ctx) for n_ctx in range(1, 2049)]
    assert all(charge % ROUND_BYTES == 0 for charge in charges)
    assert all(charge >= n_ctx * 1000 for n_ctx, charge in enumerate(charges, start=1))
    assert charges == sorted(charges)
    assert fit.charge(2048) >= 20 * MIB and fit.sizes() == [512, 1024, 1536, 2048]
    with pytest.raises(ValueError):
        fit.charge(0)


@st.composite
def cost_models(draw):
    """A full context's true cost as the fit assumes it: KV per (padded) position, a fixed part, and compute
    pages that the attention touches: a part that grows with the batch, min(512, n) rows, then a part
    linear in the padded cells it reads (none with flash attention past a point). Each probe reading is off
    by up to 64 KiB."""
    kv = draw(st.integers(min_value=1_000, max_value=200_000))
    fixed = draw(st.integers(min_value=0, max_value=8 * MIB))
    batch_part = draw(st.integers(min_value=0, max_value=64 * MIB))
    per_cell = draw(st.integers(min_value=0, max_value=40_000))
    plateau = draw(st.sampled_from([None, 1024, 1536]))
    padded = draw(st.booleans())
    largest = draw(st.integers(min_value=1, max_value=8192))

    def cells(n: int) -> int:
        return _padded(n) if padded else n

    def touched(n: int) -> int:
        read = cells(n) if plateau is None else min(cells(n), plateau)
        return batch_part * min(CALIBRATION_ROWS, n) // CALIBRATION_ROWS + per_cell * read

    def cost(n: int) -> int:  # a full context of n positions on its own
        return kv * cells(n) + fixed + touched(n)

    def reading(filled: int) -> int:  # the probed context of `largest` positions with `filled` cells full
        return kv * cells(largest) + fixed + touched(filled)

    noise = draw(st.lists(st.integers(-(1 << 16), 1 << 16), min_size=4, max_size=4))
    return kv, cost, reading, largest, noise


def _probe_of(reading, largest: int, noise: list[int]) -> Probe:
    rows = min(CALIBRATION_ROWS, largest)
    fills = [min(start + rows, largest) for start in range(0, min(largest, PROBE_CELLS), rows)]
    return Probe(largest, tuple((filled, reading(filled) + error) for filled, error in zip(fills, noise)))


@settings(max_examples=300, deadline=None)
@given(cost_models())
def test_no_size_up_to_the_largest_is_charged_less_than_it_costs_and_the_largest_not_much_more(model) -> None:
    kv, cost, reading, largest, noise = model
    fit = ChargeFit(kv, _probe_of(reading, largest, noise))
    for n_ctx in {1, 2, 63, 64, 65, 100, 255, 256, 257, 300, 511, 512, 513, 1000, 1024, 2047, 2048, 2049, 4097, largest - 1, largest}:
        if 1 <= n_ctx <= largest:
            assert fit.charge(n_ctx) >= cost(n_ctx) >= 0, n_ctx
            assert fit.charge(n_ctx) >= n_ctx * kv
    assert fit.charge(largest) <= CONVERSE_FACTOR * cost(largest) + CONVERSE_BYTES


def test_a_shared_context_is_charged_its_share_and_its_touched_pages() -> None:
    probe = Probe(1024, ((512, 30 * MIB), (1024, 44 * MIB)))
    charge = SharedContextCharge(7680, 100 * MIB, probe, 4)
    expected = (144 * MIB + 144 * MIB // 16 + MIB) // 4
    assert charge.charge(1) == charge.charge(1024) == -(-expected // ROUND_BYTES) * ROUND_BYTES
    assert charge.sizes() == [1024]


def test_a_session_that_fills_its_context_uses_no_more_than_its_charge(shards, socket_dir) -> None:
    """End to end, the point of the fit: a session filled to the daemon's largest n_ctx grows its worker's
    anonymous memory by no more than it is charged, and by what the start-up probe read for a context of
    that n_ctx (the worker's second context costs what its first did) within the fit's fixed margin.
    (Measured after one 512-row batch only, the charge was about half of what a full context touches:
    llama.cpp's compute buffers fill as the attention grows.)

    Measured here (middle shard, n_ctx 2048; 10 runs, 3 of them beside two CPU burners): probed 84.77-84.78
    MiB, grown 84.87-84.89, charged 91.12. The worker fixes glibc's mmap threshold (workers.server.main.
    fix_allocator). Before that (19 runs, 4 beside burners, 3 with MALLOC_ARENA_MAX=1, which changed nothing:
    a context's buffers are allocated on the worker's main thread, and no thread's arena grew) the second
    context came from the heap the first left: probed 88.0 (read in 2), grown 86.56-86.87, charged 94.50-94.56; and once,
    in a fresh clone's CI, 103.1 MiB grown, never reproduced here, which a 24 MiB slack let pass. Its excess,
    16.4 MiB, is what a context holds from its creation (the 15 MiB KV cache and 1.5 MiB), as if a freed
    one had stayed resident in the heap: with every buffer its own mapping, unmapped when freed, none can,
    and this test allows no slack."""
    shard = shards[1]
    n_ctx = 2048
    daemon = DaemonProcess(shard.path, socket_dir / "fill.sock",
                           "--threads", "1", "--n-ctx", str(n_ctx), "--max-sessions", "1", "--spill-budget", "0",
                           "--calibration-cache", "off")
    try:
        with daemon.client(direct=False) as client:
            pid = client.stats().workers[0].pid
            before = anonymous_bytes(pid)
            rows = np.zeros((CALIBRATION_ROWS, shard.shape.n_embd), np.float32)  # the largest batch llama.cpp computes at once
            for start in range(0, n_ctx, len(rows)):
                client.append("fill", 1, start, hidden=rows)
            grown = anonymous_bytes(pid) - before
            stats = client.stats()
        [row] = [row for row in stats.calibration if row.n_ctx == n_ctx]
        [session] = stats.sessions
        report = (f"a full context grew its worker by {grown / MIB:.2f} MiB, charged {session.charged_bytes / MIB:.2f} MiB, "
                  f"probed at start-up {row.measured_bytes / MIB:.2f} MiB")
        print(report)
        assert before > 0 and grown > 0 and not row.extrapolated and session.charged_bytes == row.charged_bytes
        assert grown <= session.charged_bytes, report
        assert abs(grown - row.measured_bytes) <= MARGIN_BYTES, report
    finally:
        daemon.stop()


def _full_context_bytes(shard_path, n_ctx: int, n_seqs: int) -> int:
    """A full context's real bytes per session, read in a fresh process (tests.support.filled_context) whose
    allocator is set as a worker's (workers.server.main.fix_allocator; glibc reads the same setting from
    its environment at start)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.filled_context", str(shard_path), str(n_ctx), str(n_seqs)],
        capture_output=True, text=True, timeout=1800, check=False, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["grown_bytes"] // n_seqs


@pytest.mark.parametrize("mode", ["process", "batched"])
def test_the_charge_is_within_15_percent_of_what_a_full_context_really_takes(shards, socket_dir, mode) -> None:
    """The converse of the promise: the start-up probe fills at most PROBE_CELLS cells, yet the charge at
    the daemon's --n-ctx (within the probe, and extrapolated beyond it) is at least what a full context
    takes and at most 15% (+2 MiB) more. Batched mode: a session's share of a context of two sequences,
    both full. What a full context takes is read in a fresh process that never held a context: a worker
    keeps freed pages, so its own growth would understate it."""
    shard = shards[1]
    n_seqs = 2 if mode == "batched" else 1
    for n_ctx in (1024, PROBE_CELLS + 1024):
        extra = ("--mode", "batched", "--seqs-per-worker", str(n_seqs)) if mode == "batched" else ("--mode", "process")
        daemon = DaemonProcess(shard.path, socket_dir / f"converse-{mode}-{n_ctx}.sock",
                               "--threads", "1", "--n-ctx", str(n_ctx), "--max-sessions", str(n_seqs), "--spill-budget", "0",
                               "--calibration-cache", "off", *extra)
        try:
            with daemon.client(direct=False) as client:
                stats = client.stats()
        finally:
            daemon.stop()
        assert stats.mode == mode and stats.counters["calibrations"] == 1
        [row] = [row for row in stats.calibration if row.n_ctx == n_ctx]
        assert row.extrapolated == (n_ctx > PROBE_CELLS)
        real = _full_context_bytes(shard.path, n_ctx, n_seqs)
        report = f"{mode} n_ctx {n_ctx}: charged {row.charged_bytes / MIB:.1f} MiB, a full context takes {real / MIB:.1f} MiB"
        print(report)
        assert real <= row.charged_bytes <= CONVERSE_FACTOR * real + CONVERSE_BYTES, report

"""The charge fit: every n_ctx up to the daemon's largest is charged at least what it costs, from two sizes
measured at start-up (pure), and one daemon end to end: a full context within its charge (more in
test_daemon.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.daemon.admission.calibration import CALIBRATION_ROWS, LLAMA_CTX_PAD, ROUND_BYTES, SMALL_N_CTX, ChargeFit
from tests.daemons import DaemonProcess
from workers.server.main import anonymous_bytes

MIB = 1 << 20

# Measured on the middle shard [10, 20) of the bundled model (anonymous memory after one batch of
# min(512, n_ctx) rows, Intel Xeon, llama-cpp-python 0.3.36): n_ctx -> MiB.
MIDDLE_SHARD_KV_PER_POSITION = 7680
MIDDLE_SHARD_MEASURED_MIB = {64: 6.09, 128: 8.93, 256: 13.76, 300: 19.88, 512: 30.19, 1024: 35.18, 2048: 43.9}


def _bytes(mib: float) -> int:
    return int(mib * MIB)


def test_the_fit_of_two_measured_sizes_covers_every_size_measured_on_the_bundled_model() -> None:
    measured = MIDDLE_SHARD_MEASURED_MIB
    fit = ChargeFit(MIDDLE_SHARD_KV_PER_POSITION, ((2048, _bytes(measured[2048])), (SMALL_N_CTX, _bytes(measured[SMALL_N_CTX]))))
    for n_ctx, mib in measured.items():
        assert fit.charge(n_ctx) >= _bytes(mib), n_ctx
    # a straight line through the two measured sizes would undercharge 512 positions by half
    slope = (measured[2048] - measured[64]) / (2048 - 64)
    assert measured[64] + slope * (512 - 64) < 0.5 * measured[512]


def test_charges_are_rounded_never_below_theory_and_grow_with_n_ctx() -> None:
    fit = ChargeFit(1000, ((512, 10 * MIB), (64, 2 * MIB)))
    charges = [fit.charge(n_ctx) for n_ctx in range(1, 1025)]
    assert all(charge % ROUND_BYTES == 0 for charge in charges)
    assert all(charge >= n_ctx * 1000 for n_ctx, charge in enumerate(charges, start=1))
    assert charges == sorted(charges)
    assert fit.charge(64) >= 2 * MIB and fit.charge(512) >= 10 * MIB
    with pytest.raises(ValueError):
        fit.charge(0)
    with pytest.raises(ValueError):
        ChargeFit(1000, ())


@st.composite
def cost_models(draw):
    """A context's true cost as the fit assumes it: KV per (padded) position plus a compute part that
    grows with the batch, min(512, n) rows, and not with n beyond; readings off by up to 2%."""
    kv = draw(st.integers(min_value=1_000, max_value=200_000))
    steps = draw(st.lists(st.integers(min_value=0, max_value=4 * MIB), min_size=8, max_size=8))
    padded = draw(st.booleans())
    largest = draw(st.integers(min_value=SMALL_N_CTX + 1, max_value=8192))

    def compute(n_ctx: int) -> int:
        rows = min(CALIBRATION_ROWS, n_ctx)
        return sum(steps[: 1 + (rows - 1) * len(steps) // CALIBRATION_ROWS])

    def cost(n_ctx: int) -> int:
        cells = -(-n_ctx // LLAMA_CTX_PAD) * LLAMA_CTX_PAD if padded else n_ctx
        return kv * cells + compute(n_ctx)

    noise = draw(st.tuples(st.floats(-0.02, 0.02), st.floats(-0.02, 0.02)))
    return kv, cost, largest, noise


@settings(max_examples=200, deadline=None)
@given(cost_models())
def test_no_size_up_to_the_largest_is_charged_less_than_it_costs(model) -> None:
    kv, cost, largest, (noise_large, noise_small) = model
    fit = ChargeFit(
        kv, ((largest, int(cost(largest) * (1 + noise_large))), (SMALL_N_CTX, int(cost(SMALL_N_CTX) * (1 + noise_small))))
    )
    for n_ctx in {1, 2, 63, 64, 65, 100, 255, 256, 257, 300, 511, 512, 513, 1000, 1024, 2047, 4097, largest - 1, largest}:
        if 1 <= n_ctx <= largest:
            assert fit.charge(n_ctx) >= cost(n_ctx) >= 0, n_ctx
            assert fit.charge(n_ctx) >= n_ctx * kv


def test_a_session_that_fills_its_context_uses_no_more_than_its_charge(shards, socket_dir) -> None:
    """End to end, the point of the fit: a session filled to the daemon's largest n_ctx grows its worker's
    anonymous memory by no more than it is charged. (Measured after one 512-row batch only, the charge was
    about half of what a full context touches: llama.cpp's compute buffers fill as the attention grows.)"""
    shard = shards[1]
    n_ctx = 2048
    daemon = DaemonProcess(shard.path, socket_dir / "fill.sock",
                           "--threads", "1", "--n-ctx", str(n_ctx), "--max-sessions", "1", "--spill-budget", "0")
    try:
        with daemon.client(direct=False) as client:
            pid = client.stats().workers[0].pid
            before = anonymous_bytes(pid)
            rows = np.zeros((CALIBRATION_ROWS, shard.shape.n_embd), np.float32)  # the largest batch llama.cpp computes at once
            for start in range(0, n_ctx, len(rows)):
                client.append("fill", 1, start, hidden=rows)
            grown = anonymous_bytes(pid) - before
            charged = client.stats().sessions[0].charged_bytes
            assert before > 0 and grown > 0
            assert grown <= charged, f"a full context grew its worker by {grown / MIB:.1f} MiB, charged {charged / MIB:.1f} MiB"
    finally:
        daemon.stop()

"""Section 9, start-up: the time from `kvpool serve` to its first answered status for the rig's middle shard
at --n-ctx 512, 2048 and 8192, beside a bare llama context of the same n_ctx created in-process. Start-up
runs the charge probe (kvpool.daemon.admission.calibration), which fills min(n_ctx, PROBE_CELLS) cells:
its cost stops growing at PROBE_CELLS, so start-up should stay flat from 2048 to 8192 (the headline:
at most FLAT_TARGET), and be a little shorter at 512, where the probe fills one batch. Before the probe,
start-up filled a whole context: 4.2 s at 512, 52.8 s at 8192 on a 2-core AMD EPYC VM."""

from __future__ import annotations

import time

from kvpool.bench.options import bench_say, median_of
from kvpool.bench.rig import Rig, time_call
from kvpool.bench.table import Row, headline
from kvpool.client.client import Client
from kvpool.daemon.admission.calibration import PROBE_CELLS
from kvpool.launcher import Daemon

STARTUP_N_CTX = (512, PROBE_CELLS, 8192)
FLAT_TARGET = 1.25  # start-up at 8192 / at PROBE_CELLS: at most this (1.0 is flat)


def _start_once(rig: Rig, n_ctx: int) -> dict:
    socket = rig.socket_dir / f"startup-{n_ctx}.sock"
    started = time.perf_counter()
    daemon = Daemon(rig.middle.path, socket, ["--n-ctx", str(n_ctx), "--threads", "1", "--max-sessions", "1", "--spill-budget", "0"])
    try:
        daemon.wait_ready()
        ready_s = time.perf_counter() - started
        with Client(socket, name="kvpool-bench") as client:
            stats = client.stats()
        probed = max(row.n_ctx for row in stats.calibration if not row.extrapolated)
        charged = next(row.charged_bytes for row in stats.calibration if row.n_ctx == n_ctx)
    finally:
        daemon.stop()
    return {"ready_s": ready_s, "probed_cells": probed, "charged_bytes": charged}


def measure_startup(rig: Rig) -> dict:
    sizes = STARTUP_N_CTX
    repeats = 3  # a median between a min and a max, quick or not (kvpool.bench.checks.MIN_ROUNDS)
    results: dict = {"n_ctx": list(sizes), "ready_s": {}, "bare_context_s": {}, "probed_cells": {}, "charged_bytes": {}}
    for n_ctx in sizes:
        bare = [time_call(lambda: rig.mid_model.new_context(n_ctx).close()) for _ in range(3)]
        key = str(n_ctx)  # as in the JSON
        results["bare_context_s"][key] = bare
        runs = []
        for repeat in range(repeats):
            runs.append(_start_once(rig, n_ctx))
            bench_say(f"  n_ctx {n_ctx}: ready in {runs[-1]['ready_s']:.1f} s (run {repeat + 1} of {repeats})")
        results["ready_s"][key] = [run["ready_s"] for run in runs]
        results["probed_cells"][key] = runs[-1]["probed_cells"]
        results["charged_bytes"][key] = runs[-1]["charged_bytes"]
    return results


def summarize_startup(startup: dict) -> tuple[dict, dict, list[Row]]:
    sizes = startup["n_ctx"]
    ready = {n: median_of(startup["ready_s"][str(n)]) for n in sizes}
    bare = {n: median_of(startup["bare_context_s"][str(n)]) for n in sizes}
    smallest, probed, largest = sizes
    flat = ready[largest] / ready[probed]
    summary = {f"s9_ready_s_{n}": ready[n] for n in sizes} | {f"s9_bare_context_s_{n}": bare[n] for n in sizes}
    summary["s9_start_growth"] = flat
    summary["s9_start_growth_from_smallest"] = ready[largest] / ready[smallest]
    ratios = {"s9_start_growth": headline(flat, FLAT_TARGET, at_most=True)}
    rows = [
        Row("9", f"`kvpool serve` to first status, middle shard, n_ctx {n} (probe fills {startup['probed_cells'][str(n)]} of max {PROBE_CELLS} cells)",
            f"{ready[n]:.2f} s", f"bare context {bare[n] * 1e3:.1f} ms", "")
        for n in sizes
    ]
    rows.append(Row("9", f"start-up at n_ctx {largest} / at n_ctx {probed} (1.0: flat; the probe fills {probed} cells in both)",
                    f"{ready[largest]:.2f} s", f"{ready[probed]:.2f} s", f"{flat:.2f}", f"<= {FLAT_TARGET:.2f}: {'met' if flat <= FLAT_TARGET else 'MISSED'}"))
    rows.append(Row("9", f"start-up at n_ctx {largest} / at n_ctx {smallest} (a full-context fill: 12.4)", f"{ready[largest]:.2f} s",
                    f"{ready[smallest]:.2f} s", f"{ready[largest] / ready[smallest]:.2f}", ""))
    return summary, ratios, rows

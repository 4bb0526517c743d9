"""Section 9, start-up: the time from `kvpool serve` to its first answered status for the rig's middle shard
at --n-ctx 512, 2048 and 8192, beside a bare llama context of the same n_ctx created in-process and the shard's
model load in process. A first start on a machine (--calibration-cache off: nothing kept) runs the charge probe
(kvpool.daemon.admission.calibration), which fills min(n_ctx, PROBE_CELLS) cells: its cost stops growing at
PROBE_CELLS, so a first start stays flat from 2048 to 8192 (at most FLAT_TARGET). A restart (the default,
--calibration-cache user, here a folder of the bench's own that the first round filled) takes its charges from
the readings kept by an earlier start and computes nothing: issue 29's targets, judged on restarts, are ready at
8192 within RESTART_FACTOR x ready at 512 + RESTART_SLACK_S, and within the model load + LOAD_SLACK_S. Before the
probe, start-up filled a whole context: 4.2 s at 512, 52.8 s at 8192 on a 2-core AMD EPYC VM."""

from __future__ import annotations

import pathlib
import time

from kvpool.bench.options import bench_say, median_of
from kvpool.bench.rig import time_call
from kvpool.bench.table import Row, headline
from kvpool.client.client import Client
from kvpool.daemon.admission.calibration import PROBE_CELLS
from kvpool.launcher import Daemon
from workers.runtime.model import ShardModel

STARTUP_N_CTX = (512, PROBE_CELLS, 8192)
FLAT_TARGET = 1.25  # a first start at 8192 / at PROBE_CELLS: at most this (1.0 is flat)
RESTART_FACTOR, RESTART_SLACK_S = 1.5, 1.0  # a restart at 8192 <= 1.5 x a restart at 512 + 1 s (issue 29)
LOAD_SLACK_S = 2.0  # a restart <= the model load + 2 s (issue 29)


def _start_once(shard: pathlib.Path, socket_dir: pathlib.Path, n_ctx: int, cache: str) -> dict:
    socket = socket_dir / f"startup-{n_ctx}.sock"
    started = time.perf_counter()
    daemon = Daemon(shard, socket, ["--n-ctx", str(n_ctx), "--threads", "1", "--max-sessions", "1", "--spill-budget", "0",
                                              "--calibration-cache", cache])
    try:
        daemon.wait_ready()
        ready_s = time.perf_counter() - started
        with Client(socket, name="kvpool-bench") as client:
            stats = client.stats()
        probed = max(row.n_ctx for row in stats.calibration if not row.extrapolated)
        charged = next(row.charged_bytes for row in stats.calibration if row.n_ctx == n_ctx)
    finally:
        daemon.stop()
    return {"ready_s": ready_s, "probed_cells": probed, "charged_bytes": charged, "probes": stats.counters["calibrations"],
            "cached": stats.counters["calibrations_cached"]}


def _load_model(shard: pathlib.Path) -> None:
    with ShardModel(shard):
        pass


def measure_startup(shard: pathlib.Path, socket_dir: pathlib.Path) -> dict:
    """Section 9 on `shard` (the middle one), its daemons' sockets in `socket_dir`."""
    sizes = STARTUP_N_CTX
    repeats = 3  # a median between a min and a max, quick or not (kvpool.bench.checks.MIN_ROUNDS)
    kept = socket_dir / "calibration"  # the bench's own: the user's cache is neither read nor filled here
    results: dict = {"n_ctx": list(sizes), "ready_s": {}, "restart_ready_s": {}, "bare_context_s": {}, "probed_cells": {},
                     "charged_bytes": {}, "restart_charged_bytes": {}, "restart_probes": {}, "restart_cached": {},
                     "model_load_s": [time_call(lambda: _load_model(shard)) for _ in range(repeats)]}
    with ShardModel(shard) as model:
        bare = {n_ctx: [time_call(lambda: model.new_context(n_ctx).close()) for _ in range(3)] for n_ctx in sizes}
    for n_ctx in sizes:
        key = str(n_ctx)  # as in the JSON
        results["bare_context_s"][key] = bare[n_ctx]
        firsts = []
        for repeat in range(repeats):  # the first round keeps its readings for the restarts; the others keep nothing
            firsts.append(_start_once(shard, socket_dir, n_ctx, str(kept) if repeat == 0 else "off"))
            bench_say(f"  n_ctx {n_ctx}: a first start ready in {firsts[-1]['ready_s']:.1f} s (run {repeat + 1} of {repeats})")
        restarts = []
        for repeat in range(repeats):
            restarts.append(_start_once(shard, socket_dir, n_ctx, str(kept)))
            bench_say(f"  n_ctx {n_ctx}: a restart (readings kept) ready in {restarts[-1]['ready_s']:.1f} s (run {repeat + 1} of {repeats})")
        results["ready_s"][key] = [run["ready_s"] for run in firsts]
        results["restart_ready_s"][key] = [run["ready_s"] for run in restarts]
        results["probed_cells"][key] = firsts[-1]["probed_cells"]
        # the charge of the first run, whose readings the restarts read (the others probe again: their
        # readings may differ by a page or so, and are kept nowhere)
        results["charged_bytes"][key] = firsts[0]["charged_bytes"]
        results["restart_charged_bytes"][key] = restarts[-1]["charged_bytes"]
        results["restart_probes"][key] = [run["probes"] for run in restarts]
        results["restart_cached"][key] = [run["cached"] for run in restarts]
    return results


def summarize_startup(startup: dict) -> tuple[dict, dict, list[Row]]:
    sizes = startup["n_ctx"]
    ready = {n: median_of(startup["ready_s"][str(n)]) for n in sizes}
    restart = {n: median_of(startup["restart_ready_s"][str(n)]) for n in sizes}
    bare = {n: median_of(startup["bare_context_s"][str(n)]) for n in sizes}
    load = median_of(startup["model_load_s"])
    smallest, probed, largest = sizes
    flat = ready[largest] / ready[probed]
    restart_bound = RESTART_FACTOR * restart[smallest] + RESTART_SLACK_S
    load_bound = load + LOAD_SLACK_S
    summary = ({f"s9_ready_s_{n}": ready[n] for n in sizes} | {f"s9_restart_ready_s_{n}": restart[n] for n in sizes}
               | {f"s9_bare_context_s_{n}": bare[n] for n in sizes})
    summary["s9_model_load_s"] = load
    summary["s9_start_growth"] = flat
    summary["s9_start_growth_from_smallest"] = ready[largest] / ready[smallest]
    ratios = {
        "s9_start_growth": headline(flat, FLAT_TARGET, at_most=True),
        "s9_restart_vs_bound": headline(restart[largest] / restart_bound, 1.0, at_most=True),
        "s9_restart_vs_load_bound": headline(restart[largest] / load_bound, 1.0, at_most=True),
    }
    rows = [
        Row("9", f"first start (nothing kept), middle shard, n_ctx {n} (probe fills {startup['probed_cells'][str(n)]} of max {PROBE_CELLS} cells)",
            f"{ready[n]:.2f} s", f"bare context {bare[n] * 1e3:.1f} ms", "")
        for n in sizes
    ]
    rows += [
        Row("9", f"restart (readings kept: {max(startup['restart_probes'][str(n)])} probes), middle shard, n_ctx {n}",
            f"{restart[n]:.2f} s", f"model load {load * 1e3:.1f} ms", "")
        for n in sizes
    ]
    rows.append(Row("9", f"first start at n_ctx {largest} / at n_ctx {probed} (1.0: flat; the probe fills {probed} cells in both)",
                    f"{ready[largest]:.2f} s", f"{ready[probed]:.2f} s", f"{flat:.2f}", f"<= {FLAT_TARGET:.2f}: {'met' if flat <= FLAT_TARGET else 'MISSED'}"))
    rows.append(Row("9", f"first start at n_ctx {largest} / at n_ctx {smallest} (a full-context fill: 12.4)", f"{ready[largest]:.2f} s",
                    f"{ready[smallest]:.2f} s", f"{ready[largest] / ready[smallest]:.2f}", ""))
    met = restart[largest] <= restart_bound
    rows.append(Row("9", f"restart at n_ctx {largest} against {RESTART_FACTOR:g} x restart at n_ctx {smallest} + {RESTART_SLACK_S:g} s",
                    f"{restart[largest]:.2f} s", f"{restart_bound:.2f} s", f"{restart[largest] / restart_bound:.2f}", f"<= 1.00: {'met' if met else 'MISSED'}"))
    met = restart[largest] <= load_bound
    rows.append(Row("9", f"restart at n_ctx {largest} against the model load + {LOAD_SLACK_S:g} s",
                    f"{restart[largest]:.2f} s", f"{load_bound:.2f} s", f"{restart[largest] / load_bound:.2f}", f"<= 1.00: {'met' if met else 'MISSED'}"))
    return summary, ratios, rows

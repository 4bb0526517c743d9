"""`kvpool bench --rigs N`: the same run N times, each in a fresh process with daemons and in-process references of
its own (a rig), every headline ratio's verdict taken on its median across the rigs.

Why: the same model decodes a few percent faster or slower from one process to the next. The ~1B model's whole-model
step (one thread) took 69.7-71.3 ms in five fresh processes, and the bench's own in-process reference 68.9 and 72.7
ms in two runs twenty minutes apart, so one run read the route at 0.941x of the whole model and the next at 0.999x
(evidence/daemon-overhead/README.md, "Stop 46"; where each process's memory lands is the likely cause, not shown).
Within a run every variant keeps the process, and the memory, it started with, so the interleaved rounds average
out the machine's moments, not that draw: a ratio within a few percent of its target reads met or missed by the
draw of one run. Each rig draws again, in a spawned interpreter with daemons of its own."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import pathlib
import statistics
from collections.abc import Callable, Sequence

from kvpool.bench.checks import VERDICTS, with_verdict
from kvpool.bench.options import BenchOptions, bench_say, write_results
from kvpool.bench.table import headline

MAX_RIGS = 9


class RigFailed(Exception):
    """A rig's process ended without its results."""


def check_rigs(count: int) -> int:
    if not 1 <= count <= MAX_RIGS:
        raise ValueError(f"--rigs takes 1 to {MAX_RIGS} runs (got {count})")
    return count


def rig_options(options: BenchOptions, index: int) -> BenchOptions:
    """Rig `index`'s options (from 1): its results in <out>/rig-<index>, no chart, no --json copy."""
    return dataclasses.replace(options, out_dir=options.out_dir / f"rig-{index}", chart=False, json_path=None)


def combine(runs: Sequence[dict]) -> dict:
    """Every headline ratio the runs share: its value in each, the median, min and max, and the verdict of its target
    on the median - or, when any rig withheld its verdict (contended, a broken reference), that reason and rig."""
    if not runs:
        raise ValueError("no runs to combine")
    names = [name for name in runs[0]["ratios"] if all(name in run["ratios"] for run in runs)]
    missing = sorted({name for run in runs for name in run["ratios"]} - set(names))
    if missing:
        bench_say(f"not in every rig, so not combined: {', '.join(missing)}")
    ratios = {}
    for name in names:
        entries = [run["ratios"][name] for run in runs]
        values = [entry["value"] for entry in entries]
        first = entries[0]
        combined = headline(statistics.median(values), first["target"], at_most=first["at_most"])
        withheld = [(index, entry["verdict"]) for index, entry in enumerate(entries, start=1) if entry["verdict"] not in VERDICTS]
        if withheld:
            combined = {**combined, "met": None, "verdict": "; ".join(f"rig {index}: {why}" for index, why in withheld)}
        ratios[name] = with_verdict({**combined, "values": values, "min": min(values), "max": max(values)})
    return ratios


def render(ratios: dict) -> str:
    """The table of the combined ratios: each rig's value, the median, the spread and the verdict on the median."""
    count = len(next(iter(ratios.values()))["values"]) if ratios else 0
    lines = ["| ratio | " + " | ".join(f"rig {index}" for index in range(1, count + 1)) + " | median (min-max) | target | verdict on the median |",
             "|---|" + "---|" * count + "---|---|---|"]
    for name, ratio in ratios.items():
        target = "" if ratio["target"] is None else f"{'<=' if ratio['at_most'] else '>='} {ratio['target']:.2f}"
        cells = " | ".join(f"{value:.3f}" for value in ratio["values"])
        lines.append(f"| {name} | {cells} | {ratio['value']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}) | {target} | {ratio['verdict']} |")
    return "\n".join(lines)


def run_rigs(run: Callable[[BenchOptions], object], options: BenchOptions, count: int, json_name: str) -> tuple[dict, str]:
    """`run` (a module-level function taking BenchOptions: kvpool.bench.cli's whole run or its --only run) `count`
    times, each in a spawned process of its own, one after another; each writes <out>/rig-K/`json_name`. Writes
    <out>/<json_name stem>-rigs.json: every rig's headline ratios and their combination (`combine`)."""
    check_rigs(count)
    context = multiprocessing.get_context("spawn")
    runs, paths = [], []
    for index in range(1, count + 1):
        rig = rig_options(options, index)
        bench_say(f"rig {index}/{count}: a fresh process, its own daemons and references (results in {rig.out_dir})")
        process = context.Process(target=run, args=(rig,), name=f"kvpool-bench-rig-{index}")
        process.start()
        try:
            process.join()
        finally:
            if process.is_alive():  # interrupted here: the rig ends too (its daemons follow it: kvpool.launcher's lifeline)
                process.terminate()
                process.join()
        if process.exitcode != 0:
            raise RigFailed(f"rig {index} of {count} failed (exit code {process.exitcode}); the rigs before it are in {options.out_dir}")
        path = rig.out_dir / json_name
        runs.append(json.loads(path.read_text()))
        paths.append(str(path))
    ratios = combine(runs)
    table = render(ratios)
    results = {
        "rigs": count, "runs": paths, "ratios": ratios, "table": table,
        "environments": [done["environment"] for done in runs],
        "tables": [done["table"] for done in runs],
    }
    write_results(results, options.out_dir / f"{pathlib.Path(json_name).stem}-rigs.json", options.json_path)
    for index, run_table in enumerate(results["tables"], start=1):
        print(f"rig {index}:\n{run_table}\n")
    return results, table

"""The report of section 3, four sessions at once (measured by kvpool.bench.parallel): aggregate decode
rates against llama.cpp batched and the no-IPC ceiling, and where the cores' time per token goes. A batched
reference slower in aggregate than one sequence alone (kvpool.bench.checks.broken_reference) is reported as
broken, and no ratio against it gets a verdict."""

from __future__ import annotations

import dataclasses

from kvpool.bench.checks import BROKEN, broken_reference, withhold
from kvpool.bench.options import PARALLEL_THREADS, median_of
from kvpool.bench.parallel import BATCHED_CHAIN, BATCHED_WHOLE, CEILING
from kvpool.bench.table import Row, headline, ms, share, verdict
from kvpool.bench.targets import HOT_PATH_TARGETS, PARALLEL_TARGET


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_").replace("__", "_")


def alone_rates(results: dict) -> dict[str, float]:
    """Median tok/s of one sequence alone for each llama.cpp batched variant: in the same context (section 3's
    "alone_tokens_per_s"), else the same model's one-sequence decode in section 2 (1 thread; a run from before
    the self-check), else none."""
    parallel = results["parallel"]
    batched_names = [name for name in parallel["tokens_per_s"] if name.startswith("llama.cpp")]
    alone = {name: median_of(values) for name, values in parallel.get("alone_tokens_per_s", {}).items() if values}
    if not alone and "route" in results:
        whole_s = median_of(results["route"]["decode_s"]["llama.cpp whole"])
        alone = {name: 1 / whole_s for name in batched_names}
    return alone


def summarize_parallel(results: dict) -> tuple[dict, dict, list[Row]]:
    """Section 3's medians, headline ratios and table rows."""
    summary: dict[str, float | int | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []

    parallel = {name: median_of(values) for name, values in results["parallel"]["tokens_per_s"].items()}
    spread = {name: f" (rounds {min(values):.0f}-{max(values):.0f})" for name, values in results["parallel"]["tokens_per_s"].items()}
    batched_names = [name for name in parallel if name.startswith("llama.cpp")]
    ceiling = parallel[CEILING]
    best_name = max(batched_names, key=lambda name: parallel[name])
    best = parallel[best_name]
    summary["s3_best_batched_tok_s"] = best
    for name, rate in parallel.items():
        summary[f"s3_{_slug(name)}_tok_s"] = rate
    alone = alone_rates(results)
    broken = {name: broken_reference(parallel[name], alone[name]) for name in batched_names if name in alone}
    summary["s3_reference_broken"] = broken.get(best_name, False)
    for name in batched_names:
        check = "" if name not in alone else (f"; BROKEN: slower than 1 sequence alone ({alone[name]:.0f} tok/s)" if broken[name]
                                              else f"; 1 sequence alone {alone[name]:.0f} tok/s")
        rows.append(Row("3", f"four sessions, aggregate decode: {name}, {PARALLEL_THREADS} threads", "", f"{parallel[name]:.0f} tok/s{spread[name]}{check}",
                        "reference" if name == best_name else f"{parallel[name] / best:.3f}x of the best",
                        BROKEN if broken.get(name) else ""))
    summary["s3_ceiling_vs_batched"] = ceiling / best
    rows.append(Row("3", f"four sessions, ceiling of kvpool's schedule ({CEILING}, in-process llama.cpp) vs the best batched",
                    f"{ceiling:.0f} tok/s{spread[CEILING]}", f"{best:.0f} tok/s", f"{ceiling / best:.3f}x tok/s"))
    cpu_rounds = results["parallel"]["whole_daemon_cpu_s_per_token"]
    cpu = {part: median_of([sample[part] for sample in cpu_rounds]) for part in ("workers", "supervisor", "router")}
    whole_rate = parallel["kvpool whole model, 1 daemon"]
    budget = PARALLEL_THREADS / whole_rate
    idle = budget - sum(cpu.values())
    summary.update({f"s3_whole_cpu_{part}_s_per_token": value for part, value in cpu.items()})
    rows.append(Row("3", f"four sessions, kvpool whole model: where the {PARALLEL_THREADS} cores' time per token goes "
                         f"({PARALLEL_THREADS} cores / its rate = {ms(budget)}) vs the no-IPC ceiling's {ms(PARALLEL_THREADS / ceiling)}",
                    f"workers {ms(cpu['workers'])}; supervisor {ms(cpu['supervisor'])}; router (this process) {ms(cpu['router'])}; idle {ms(idle)}",
                    f"{ms(PARALLEL_THREADS / ceiling)} compute", f"{share(cpu['workers'], budget)} / {share(cpu['supervisor'], budget)} / "
                    f"{share(cpu['router'], budget)} / {share(idle, budget)}"))
    notes = {
        "kvpool whole model, 1 daemon": f"--threads {PARALLEL_THREADS} --threads-per-worker 1: at most {PARALLEL_THREADS} workers compute",
        "kvpool 3-shard chain, capped at 2 in flight": f"3 daemons x --threads 1; router allows {PARALLEL_THREADS} appends in flight: at most {PARALLEL_THREADS} threads",
        "kvpool 3-shard chain, uncapped": "3 daemons x --threads 1: up to 3 single threads on 2 cores",
        BATCHED_WHOLE: f"one worker process, 4 sequences of one context, {PARALLEL_THREADS} threads",
        BATCHED_CHAIN: "3 daemons x one worker of 4 sequences x 1 thread; router allows 2 appends in flight",
    }
    notes = {name: note for name, note in notes.items() if name in parallel}  # a run from before batched mode has none
    for name, note in notes.items():
        ratio = parallel[name] / best
        summary[f"s3_{_slug(name)}_vs_batched"] = ratio
        ratios[f"{_slug(name)}_vs_batched"] = headline(ratio, None if "uncapped" in name else PARALLEL_TARGET)
        rows.append(Row("3", f"four sessions: {name} ({note}) vs the best llama.cpp batched", f"{parallel[name]:.0f} tok/s{spread[name]}", f"{best:.0f} tok/s",
                        f"{ratio:.3f}x tok/s", verdict(ratio, PARALLEL_TARGET) if "uncapped" not in name else "(3 threads: not counted)"))

    counted = ("kvpool whole model, 1 daemon", "kvpool 3-shard chain, capped at 2 in flight", BATCHED_WHOLE, BATCHED_CHAIN)
    kvpool_best = max(parallel[name] for name in counted if name in parallel)
    if BATCHED_WHOLE in parallel:
        process_whole, batched_whole = parallel["kvpool whole model, 1 daemon"], parallel[BATCHED_WHOLE]
        summary["s3_batched_faster_whole_model"] = batched_whole > process_whole
        ratios["four_sessions_batched_vs_process_mode"] = headline(batched_whole / process_whole, None)
        rows.append(Row("3", "four sessions, whole model: --mode batched vs --mode process (the faster is the mode to run on this machine)",
                        f"{batched_whole:.0f} tok/s", f"{process_whole:.0f} tok/s", f"{batched_whole / process_whole:.3f}x tok/s"))
    auto = results["parallel"].get("auto")
    if auto is not None and BATCHED_WHOLE in parallel:
        faster = "batched" if summary["s3_batched_faster_whole_model"] else "process"
        summary["s3_auto_picked_batched"] = auto["mode"] == "batched"
        summary["s3_auto_picked_the_faster"] = auto["mode"] == faster
        rows.append(Row("3", f"four sessions, whole model: --mode auto picks {auto['mode']} (its start-up probe: batched {auto['probe_batched_tok_s']:.0f} tok/s, "
                             f"process ceiling {auto['probe_process_tok_s']:.0f} tok/s); faster in the rows above: {faster}",
                        auto["mode"], faster, "same" if auto["mode"] == faster else "DIFFERENT"))
    ratios["four_sessions_vs_batched"] = headline(kvpool_best / best, HOT_PATH_TARGETS["four_sessions_vs_batched"])
    ratios["four_sessions_vs_ceiling"] = headline(parallel["kvpool whole model, 1 daemon"] / ceiling, HOT_PATH_TARGETS["four_sessions_vs_ceiling"])
    rows.append(Row("3", "four sessions: kvpool's best mode here vs the best llama.cpp batched (>= 1.2 on the machine of record)",
                    f"{kvpool_best:.0f} tok/s", f"{best:.0f} tok/s", f"{kvpool_best / best:.3f}x tok/s",
                    verdict(kvpool_best / best, HOT_PATH_TARGETS["four_sessions_vs_batched"])))
    rows.append(Row("3", f"four sessions: kvpool whole model vs the same schedule without IPC ({CEILING})",
                    f"{parallel['kvpool whole model, 1 daemon']:.0f} tok/s", f"{ceiling:.0f} tok/s", f"{parallel['kvpool whole model, 1 daemon'] / ceiling:.3f}x tok/s",
                    verdict(parallel["kvpool whole model, 1 daemon"] / ceiling, HOT_PATH_TARGETS["four_sessions_vs_ceiling"])))
    if summary["s3_reference_broken"]:
        return summary, *withhold_broken(ratios, rows, best_name, best, alone[best_name])
    return summary, ratios, rows


def withhold_broken(ratios: dict[str, dict], rows: list[Row], best_name: str, best: float, alone: float) -> tuple[dict[str, dict], list[Row]]:
    """Section 3's ratios and rows when its best batched reference is broken: every ratio against it keeps its
    value with the verdict BROKEN, and every row comparing with it says why in its target cell."""
    why = f"{BROKEN} ({best_name}: {best:.0f} tok/s for 4 < {alone:.0f} tok/s for 1 alone)"
    ratios = {name: withhold(ratio, BROKEN) if name.endswith("_vs_batched") else ratio for name, ratio in ratios.items()}
    rows = [dataclasses.replace(row, target=why) if "best llama.cpp batched" in row.what or "vs the best batched" in row.what else row
            for row in rows]
    return ratios, rows

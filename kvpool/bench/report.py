"""The report of one run: medians and ratios (`summarize`), the table, and the PNG chart."""

from __future__ import annotations

import math
import pathlib
import statistics

from kvpool.bench.one_session import IDLE_CHAIN_S, IDLE_MID_S
from kvpool.bench.options import PARALLEL_THREADS, SESSIONS, median_of, as_mib
from kvpool.bench.overload import summarize_overload
from kvpool.bench.parallel import BATCHED_CHAIN, BATCHED_WHOLE, CEILING
from kvpool.bench.table import Row, headline, ms, verdict
from kvpool.bench.warm import draw_warm, summarize_warm

DAEMON_OVERHEAD_TARGET = 0.95  # daemon tok/s >= 0.95 x in-process tok/s
PARALLEL_TARGET = 1.2  # kvpool aggregate tok/s >= 1.2 x llama.cpp batched


# ---- the report: one table, JSON, chart -------------------------------------------------------------


HOT_PATH_TARGETS = {  # issue 11's targets, the JSON "ratios" keys
    "daemon_vs_inprocess": 0.97, "route_vs_whole": 0.93, "four_sessions_vs_batched": 1.0, "four_sessions_vs_ceiling": 0.95,
    "first_admission_vs_bare": 1.5,
}


def _rate(seconds: float) -> str:
    return f"{1 / seconds:.0f} tok/s ({ms(seconds)})"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_").replace("__", "_")


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "n/a"


def summarize(results: dict) -> tuple[dict, dict, list[Row]]:
    """Medians and ratios from the raw measurements (summary); the headline ratios by name, each with its
    target (JSON "ratios"); the table rows."""
    summary: dict[str, float | int | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []

    mid = results["mid_shard"]
    decode = {name: median_of(values) for name, values in mid["decode_s"].items()}
    prefill = {name: median_of(values) for name, values in mid["prefill_s"].items()}
    mid_trip = median_of(mid["round_trip_s"]["worker_after_idle"])
    mid_trip_hot = median_of(mid["round_trip_s"]["worker"])
    mid_supervisor = median_of(mid["round_trip_s"]["supervisor"])
    overhead = decode["daemon"] - decode["runtime"]
    mid_rest = overhead - mid_trip - mid["payload_s"]
    daemon_vs_runtime = decode["runtime"] / decode["daemon"]
    ratios["daemon_vs_runtime_decode"] = headline(daemon_vs_runtime, DAEMON_OVERHEAD_TARGET)
    ratios["daemon_vs_inprocess"] = headline(daemon_vs_runtime, HOT_PATH_TARGETS["daemon_vs_inprocess"])
    summary.update({
        "s1_daemon_decode_s": decode["daemon"], "s1_runtime_decode_s": decode["runtime"], "s1_llamacpp_decode_s": decode["llama.cpp"],
        "s1_daemon_vs_runtime": daemon_vs_runtime, "s1_daemon_vs_llamacpp": decode["llama.cpp"] / decode["daemon"],
        "s1_runtime_vs_llamacpp": decode["llama.cpp"] / decode["runtime"],
        "s1_overhead_s": overhead, "s1_round_trip_after_idle_s": mid_trip, "s1_round_trip_hot_s": mid_trip_hot,
        "s1_round_trip_supervisor_only_s": mid_supervisor, "s1_payload_s": mid["payload_s"], "s1_rest_s": mid_rest,
    })
    rows += [
        Row("1", "middle shard decode: daemon vs the same shard in-process (worker runtime)", _rate(decode["daemon"]), _rate(decode["runtime"]),
            f"{daemon_vs_runtime:.3f}x tok/s", verdict(daemon_vs_runtime, DAEMON_OVERHEAD_TARGET)),
        Row("1", "middle shard decode: daemon vs llama.cpp in-process, no capture", _rate(decode["daemon"]), _rate(decode["llama.cpp"]),
            f"{decode['llama.cpp'] / decode['daemon']:.3f}x tok/s"),
        Row("1", "middle shard decode: worker runtime (capture, graph stopped) vs llama.cpp, no capture", _rate(decode["runtime"]), _rate(decode["llama.cpp"]),
            f"{decode['llama.cpp'] / decode['runtime']:.3f}x tok/s"),
        Row("1", "daemon overhead per token (daemon minus worker runtime)", ms(overhead), "", "100%"),
        Row("1", f"  round trip client-supervisor-worker-back, no compute, after {IDLE_MID_S * 1e3:.0f} ms idle "
                 f"(hot: {ms(mid_trip_hot)}; supervisor only: {ms(mid_supervisor)})", ms(mid_trip), "", _share(mid_trip, overhead)),
        Row("1", "  payload: encode, decode, shared-memory copies of one row each way (replayed in-process, hot caches)",
            ms(mid["payload_s"]), "", _share(mid["payload_s"], overhead)),
        Row("1", "  rest: append bookkeeping in supervisor and worker, compute-slot semaphore, scheduling", ms(mid_rest), "", _share(mid_rest, overhead)),
    ]

    route = results["route"]
    greedy = {name: median_of(values) for name, values in route["decode_s"].items()}
    whole, local, chain = greedy["llama.cpp whole"], greedy["in-process chain"], greedy["daemon chain"]
    difference = chain - whole
    split = local - whole
    trips = sum(median_of(hop["worker_after_idle"]) for hop in route["round_trip_s"])
    trips_hot = sum(median_of(hop["worker"]) for hop in route["round_trip_s"])
    payload = sum(route["payload_s_per_hop"])
    rest = chain - local - trips - payload
    summary.update({
        "s2_chain_decode_s": chain, "s2_whole_decode_s": whole, "s2_local_chain_decode_s": local, "s2_daemon_whole_decode_s": greedy["daemon whole"],
        "s2_chain_vs_whole": whole / chain, "s2_split_s": split, "s2_round_trips_s": trips, "s2_round_trips_hot_s": trips_hot, "s2_payload_s": payload, "s2_rest_s": rest,
        "s2_tokens_identical": all(route["tokens_identical"].values()),
    })
    sampled = greedy["daemon chain, sampled on the last"]
    summary.update({"s2_sampled_chain_decode_s": sampled, "s2_sampled_chain_vs_whole": whole / sampled})
    ratios["route_vs_whole"] = headline(whole / sampled, HOT_PATH_TARGETS["route_vs_whole"])
    rows += [
        Row("2", "greedy decode, one session: 3 shard daemons, the token picked on the last (sampling) vs the whole model in one context",
            _rate(sampled), _rate(whole), f"{whole / sampled:.3f}x tok/s", verdict(whole / sampled, HOT_PATH_TARGETS["route_vs_whole"])),
        Row("2", "greedy decode, one session: 3 shard daemons vs the whole model in one llama.cpp context", _rate(chain), _rate(whole), f"{whole / chain:.3f}x tok/s"),
        Row("2", "greedy decode: whole model through 1 daemon vs in one llama.cpp context", _rate(greedy["daemon whole"]), _rate(whole),
            f"{whole / greedy['daemon whole']:.3f}x tok/s"),
        Row("2", "greedy decode: 3 shards in-process (LocalChain) vs the whole model in one context", _rate(local), _rate(whole), f"{whole / local:.3f}x tok/s"),
        Row("2", "where the difference goes (3 daemons minus whole model), per token", ms(difference), "", "100%"),
        Row("2", "  split into 3 contexts in-process: 3 graphs, capture, Python (LocalChain minus whole)", ms(split), "", _share(split, difference)),
        Row("2", f"  IPC round trips: 3 x client-supervisor-worker-back after {IDLE_CHAIN_S * 1e3:.0f} ms idle (hot: {ms(trips_hot)})",
            ms(trips), "", _share(trips, difference)),
        Row("2", "  payload: 2 hidden-state hops + 192 KiB of logits, encode/decode/copies (replayed in-process, hot caches)", ms(payload), "", _share(payload, difference)),
        Row("2", "  rest: append bookkeeping, thread hand-offs, scheduling (daemons minus LocalChain minus the two above)", ms(rest), "", _share(rest, difference)),
        Row("2", "greedy tokens identical in all five paths", "yes" if summary["s2_tokens_identical"] else "NO", "", ""),
    ]

    parallel = {name: median_of(values) for name, values in results["parallel"]["tokens_per_s"].items()}
    spread = {name: f" (rounds {min(values):.0f}-{max(values):.0f})" for name, values in results["parallel"]["tokens_per_s"].items()}
    batched_names = [name for name in parallel if name.startswith("llama.cpp")]
    ceiling = parallel[CEILING]
    best_name = max(batched_names, key=lambda name: parallel[name])
    best = parallel[best_name]
    summary["s3_best_batched_tok_s"] = best
    for name, rate in parallel.items():
        summary[f"s3_{_slug(name)}_tok_s"] = rate
    for name in batched_names:
        rows.append(Row("3", f"four sessions, aggregate decode: {name}, {PARALLEL_THREADS} threads", "", f"{parallel[name]:.0f} tok/s{spread[name]}",
                        "reference" if name == best_name else f"{parallel[name] / best:.3f}x of the best"))
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
                    f"{ms(PARALLEL_THREADS / ceiling)} compute", f"{_share(cpu['workers'], budget)} / {_share(cpu['supervisor'], budget)} / "
                    f"{_share(cpu['router'], budget)} / {_share(idle, budget)}"))
    notes = {
        "kvpool whole model, 1 daemon": f"--threads {PARALLEL_THREADS} --threads-per-worker 1: at most {PARALLEL_THREADS} workers compute",
        "kvpool 3-shard chain, capped at 2 in flight": f"3 daemons x --threads 1; router allows {PARALLEL_THREADS} appends in flight: at most {PARALLEL_THREADS} threads",
        "kvpool 3-shard chain, uncapped": "3 daemons x --threads 1: up to 3 single threads on 2 cores",
        BATCHED_WHOLE: f"one worker process, 4 sequences of one context, {PARALLEL_THREADS} threads",
        BATCHED_CHAIN: "3 daemons x one worker of 4 sequences x 1 thread; router allows 2 appends in flight",
    }
    for name, note in notes.items():
        ratio = parallel[name] / best
        summary[f"s3_{_slug(name)}_vs_batched"] = ratio
        ratios[f"{_slug(name)}_vs_batched"] = headline(ratio, None if "uncapped" in name else PARALLEL_TARGET)
        rows.append(Row("3", f"four sessions: {name} ({note}) vs the best llama.cpp batched", f"{parallel[name]:.0f} tok/s{spread[name]}", f"{best:.0f} tok/s",
                        f"{ratio:.3f}x tok/s", verdict(ratio, PARALLEL_TARGET) if "uncapped" not in name else "(3 threads: not counted)"))

    kvpool_best = max(parallel[name] for name in ("kvpool whole model, 1 daemon", "kvpool 3-shard chain, capped at 2 in flight", BATCHED_WHOLE, BATCHED_CHAIN))
    process_whole, batched_whole = parallel["kvpool whole model, 1 daemon"], parallel[BATCHED_WHOLE]
    summary["s3_better_mode_whole_model"] = "batched" if batched_whole > process_whole else "process"
    ratios["four_sessions_batched_vs_process_mode"] = headline(batched_whole / process_whole, None)
    rows.append(Row("3", "four sessions, whole model: --mode batched vs --mode process (the faster is the mode to run on this machine)",
                    f"{batched_whole:.0f} tok/s", f"{process_whole:.0f} tok/s", f"{batched_whole / process_whole:.3f}x tok/s"))
    ratios["four_sessions_vs_batched"] = headline(kvpool_best / best, HOT_PATH_TARGETS["four_sessions_vs_batched"])
    ratios["four_sessions_vs_ceiling"] = headline(parallel["kvpool whole model, 1 daemon"] / ceiling, HOT_PATH_TARGETS["four_sessions_vs_ceiling"])
    rows.append(Row("3", "four sessions: kvpool's best mode here vs the best llama.cpp batched (>= 1.2 on the machine of record)",
                    f"{kvpool_best:.0f} tok/s", f"{best:.0f} tok/s", f"{kvpool_best / best:.3f}x tok/s",
                    verdict(kvpool_best / best, HOT_PATH_TARGETS["four_sessions_vs_batched"])))
    rows.append(Row("3", f"four sessions: kvpool whole model vs the same schedule without IPC ({CEILING})",
                    f"{parallel['kvpool whole model, 1 daemon']:.0f} tok/s", f"{ceiling:.0f} tok/s", f"{parallel['kvpool whole model, 1 daemon'] / ceiling:.3f}x tok/s",
                    verdict(parallel["kvpool whole model, 1 daemon"] / ceiling, HOT_PATH_TARGETS["four_sessions_vs_ceiling"])))

    rows_n = results["options"]["prefill_rows"]
    summary.update({"s4_daemon_prefill_s": prefill["daemon"], "s4_runtime_prefill_s": prefill["runtime"], "s4_llamacpp_prefill_s": prefill["llama.cpp"]})
    rows += [
        Row("4", f"prefill {rows_n} rows, middle shard: daemon vs in-process (worker runtime)", ms(prefill["daemon"]), ms(prefill["runtime"]),
            f"{prefill['runtime'] / prefill['daemon']:.3f}x tok/s"),
        Row("4", f"prefill {rows_n} rows: daemon vs llama.cpp in-process, no capture, last row out", ms(prefill["daemon"]), ms(prefill["llama.cpp"]),
            f"{prefill['llama.cpp'] / prefill['daemon']:.3f}x tok/s"),
    ]

    admission = results["admission"]
    decode_step = median_of(admission["decode_s"])
    summary["s5_daemon_decode_step_s"] = decode_step
    for n_ctx in results["options"]["admit_n_ctx"]:
        key = str(n_ctx)
        admit = median_of(admission["admit_s"][key])
        inprocess = median_of(admission["inprocess_admit_s"][key])
        bare = median_of(admission["bare_create_s"][key])
        net = admit - decode_step
        summary.update({f"s5_admit_{n_ctx}_s": admit, f"s5_inprocess_admit_{n_ctx}_s": inprocess, f"s5_bare_create_{n_ctx}_s": bare})
        rows.append(Row("5", f"admit n_ctx {n_ctx} on a warm worker: admitting 1-token append vs in-process create + 1-token append",
                        ms(admit), ms(inprocess), f"{admit / inprocess:.2f}x time"))
        rows.append(Row("5", f"  admission alone (minus a {ms(decode_step)} decode through the daemon) vs a bare llama context create",
                        ms(net), ms(bare), f"{net / bare:.2f}x time"))
    first = admission["first_admit_s"]
    firsts = []
    for n_ctx in results["options"]["admit_n_ctx"]:
        value = first[str(n_ctx)]
        steady = median_of(admission["admit_s"][str(n_ctx)])
        if value is None:
            firsts.append(f"{n_ctx}: at daemon start")
        else:
            summary[f"s5_first_admit_{n_ctx}_s"] = value
            firsts.append(f"{n_ctx}: {ms(value)} (+{ms(value - steady)})")
    rows.append(Row("5", "first admission of an n_ctx (charges are fitted at start-up: no admission measures)", "; ".join(firsts),
                    "steady state above", ""))
    unseen = [n for n in results["options"]["admit_n_ctx"] if first[str(n)] is not None]
    if unseen:
        largest = max(unseen)
        bare_create = median_of(admission["bare_create_s"][str(largest)])
        first_net = first[str(largest)] - decode_step  # the admitting append's decode left out, as in the rows above
        first_vs_bare = first_net / bare_create
        ratios["first_admission_vs_bare"] = headline(first_vs_bare, HOT_PATH_TARGETS["first_admission_vs_bare"], at_most=True)
        rows.append(Row("5", f"first admission of an unseen n_ctx ({largest}), its 1-token decode left out, vs a bare llama context creation",
                        ms(first_net), ms(bare_create), f"{first_vs_bare:.2f}x time", f"<= {HOT_PATH_TARGETS['first_admission_vs_bare']:.2f}: {'met' if first_vs_bare <= HOT_PATH_TARGETS['first_admission_vs_bare'] else 'MISSED'}"))
    release = median_of([v for values in admission["release_s"].values() for v in values])
    visible = median_of([v for values in admission["reclaim_visible_s"].values() for v in values])
    free = median_of([v for values in admission["bare_free_s"].values() for v in values])
    kept = {n_ctx: median_of(values) for n_ctx, values in admission["uss_kept_bytes"].items()}
    summary.update({"s5_release_s": release, "s5_reclaim_visible_s": visible, "s5_bare_free_s": free})
    summary.update({f"s5_uss_kept_{n_ctx}_bytes": value for n_ctx, value in kept.items()})
    rows.append(Row("5", "release -> bytes available: release round trip; until a stats reply shows reserved dropped",
                    f"{ms(release)}; {ms(visible)}", f"llama_free {ms(free)}", f"{release / free:.1f}x time"))
    rows.append(Row("5", "  workers' USS still held after release (vs before the admission), by n_ctx",
                    "; ".join(f"{n_ctx}: {as_mib(value):+.1f} MiB" for n_ctx, value in kept.items()), "", ""))
    evict = median_of(admission["evict_admit_s"])
    admit_2048 = median_of(admission["admit_s"]["2048"]) if "2048" in admission["admit_s"] else math.nan
    summary.update({"s5_evict_admit_s": evict, "s5_evictions_counted": admission["evictions_counted"]})
    rows.append(Row("5", f"LRU eviction + admission, n_ctx 2048, all {SESSIONS} workers bound ({admission['evictions_counted']} evictions counted, "
                         f"{admission.get('evicted_victims_parked', 0)} of them parked in the warm tier)",
                    ms(evict), f"admit on a free worker {ms(admit_2048)}", f"{evict / admit_2048:.2f}x time"))

    memory = results["memory"]
    for n_ctx in results["options"]["admit_n_ctx"]:
        figures = memory["per_session"][str(n_ctx)]
        charged, theory, growth = figures["charged_bytes"], figures["theoretical_kv_bytes"], figures["uss_growth_bytes"]
        summary.update({f"s6_charged_{n_ctx}_bytes": charged, f"s6_theory_{n_ctx}_bytes": theory, f"s6_uss_growth_{n_ctx}_bytes": growth})
        held = figures["held_before_bytes"]
        summary[f"s6_held_before_{n_ctx}_bytes"] = held
        rows.append(Row("6", f"one session n_ctx {n_ctx}: charged; measured worker USS growth (the worker held {as_mib(held):+.1f} MiB over its "
                             "start-up USS before) vs theoretical KV (n_ctx x 30 layers x (k+v) x f16)",
                        f"{as_mib(charged):.1f} MiB; {as_mib(growth):.1f} MiB", f"{as_mib(theory):.1f} MiB",
                        f"{charged / theory:.2f}x; {growth / theory:.2f}x"))
    totals = memory["daemon_uss_bytes"]
    n_ctx = memory["daemon_sessions_n_ctx"]
    per_added = (totals[str(SESSIONS)] - totals["0"]) / SESSIONS
    theory = n_ctx * memory["kv_bytes_per_position"]
    summary.update({f"s6_daemon_uss_{count}_bytes": value for count, value in totals.items()})
    rows.append(Row("6", f"whole-model daemon USS (supervisor + {SESSIONS} workers) at 0 / 1 / {SESSIONS} sessions of n_ctx {n_ctx}",
                    " / ".join(f"{as_mib(totals[key]):.0f}" for key in ("0", "1", str(SESSIONS))) + " MiB",
                    f"+{as_mib(theory):.1f} MiB KV per session", f"+{as_mib(per_added):.1f} MiB per session = {per_added / theory:.2f}x"))
    if "warm" in results:
        warm_summary, warm_ratios, warm_rows = summarize_warm(results["warm"])
        summary.update(warm_summary)
        ratios.update(warm_ratios)
        rows += warm_rows
    if "overload" in results:
        overload_summary, overload_ratios, overload_rows = summarize_overload(results["overload"])
        summary.update(overload_summary)
        ratios.update(overload_ratios)
        rows += overload_rows
    return summary, ratios, rows


def write_chart(results: dict, summary: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(2, 4, figsize=(21, 9))

    def bars(axis, labels, values, title, unit, *, colors=None, line=None) -> None:
        positions = range(len(labels))
        axis.bar(positions, values, color=colors or ["#4472c4"] * len(labels))
        axis.set_xticks(list(positions), labels, rotation=20, ha="right", fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.set_ylabel(unit)
        for position, value in zip(positions, values):
            axis.annotate(f"{value:.3g}", (position, value), ha="center", va="bottom", fontsize=8)
        if line is not None:
            axis.axhline(line[0], color="#c00000", linestyle="--", linewidth=1)
            axis.annotate(line[1], (len(labels) - 0.5, line[0]), ha="right", va="bottom", fontsize=8, color="#c00000")

    kvpool, reference = "#4472c4", "#a5a5a5"
    runtime = summary["s1_runtime_decode_s"]
    bars(axes[0][0], ["daemon", "in-process runtime", "llama.cpp no capture"],
         [1 / summary["s1_daemon_decode_s"], 1 / runtime, 1 / summary["s1_llamacpp_decode_s"]],
         "1  middle shard decode, one session", "tok/s", colors=[kvpool, reference, reference],
         line=(DAEMON_OVERHEAD_TARGET / runtime, f"target {DAEMON_OVERHEAD_TARGET}x in-process"))
    bars(axes[0][1], ["3 daemons", "1 daemon (whole)", "3 shards in-process", "llama.cpp whole"],
         [1 / summary[k] for k in ("s2_chain_decode_s", "s2_daemon_whole_decode_s", "s2_local_chain_decode_s", "s2_whole_decode_s")],
         "2  greedy decode, one session", "tok/s", colors=[kvpool, kvpool, reference, reference])
    parallel = {name: statistics.median(values) for name, values in results["parallel"]["tokens_per_s"].items()}
    short = {CEILING: "no IPC, 2 procs x 1 thread", "llama.cpp batched, unified KV": "batched, unified KV",
             "llama.cpp batched, KV stream per sequence": "batched, KV streams", "kvpool whole model, 1 daemon": "kvpool whole model",
             "kvpool 3-shard chain, capped at 2 in flight": "kvpool chain, cap 2", "kvpool 3-shard chain, uncapped": "kvpool chain, uncapped"}
    bars(axes[0][2], [short.get(name, name) for name in parallel], list(parallel.values()),
         "3  four sessions, aggregate decode", "tok/s", colors=[kvpool if name.startswith("kvpool") else reference for name in parallel],
         line=(PARALLEL_TARGET * summary["s3_best_batched_tok_s"], f"target {PARALLEL_TARGET}x batched"))
    bars(axes[1][0], ["daemon", "in-process runtime", "llama.cpp no capture"],
         [summary[k] * 1e3 for k in ("s4_daemon_prefill_s", "s4_runtime_prefill_s", "s4_llamacpp_prefill_s")],
         f"4  prefill {results['options']['prefill_rows']} rows, middle shard", "ms", colors=[kvpool, reference, reference])
    sizes = results["options"]["admit_n_ctx"]
    width = 0.25
    for offset, (key, label, color) in enumerate([("s5_admit_{}_s", "daemon admit + 1-token append", kvpool),
                                                  ("s5_inprocess_admit_{}_s", "in-process create + append", "#70ad47"),
                                                  ("s5_bare_create_{}_s", "bare llama context create", reference)]):
        axes[1][1].bar([i + (offset - 1) * width for i in range(len(sizes))], [summary[key.format(n)] * 1e3 for n in sizes], width, label=label, color=color)
    axes[1][1].set_xticks(range(len(sizes)), [f"n_ctx {n}" for n in sizes])
    axes[1][1].set_title("5  admission on a warm worker", fontsize=10)
    axes[1][1].set_ylabel("ms")
    axes[1][1].legend(fontsize=8)
    for offset, (key, label, color) in enumerate([("s6_charged_{}_bytes", "charged", kvpool), ("s6_uss_growth_{}_bytes", "measured USS growth", "#70ad47"),
                                                  ("s6_theory_{}_bytes", "theoretical KV", reference)]):
        axes[1][2].bar([i + (offset - 1) * width for i in range(len(sizes))], [as_mib(summary[key.format(n)]) for n in sizes], width, label=label, color=color)
    axes[1][2].set_xticks(range(len(sizes)), [f"n_ctx {n}" for n in sizes])
    axes[1][2].set_title("6  memory per session (whole model)", fontsize=10)
    axes[1][2].set_ylabel("MiB")
    axes[1][2].legend(fontsize=8)
    if "warm" in results:
        draw_warm(axes[0][3], axes[1][3], summary, results["options"]["warm_lengths"])
    else:
        axes[0][3].set_axis_off()
        axes[1][3].set_axis_off()
    figure.suptitle(f"kvpool vs llama.cpp, {results['environment']['date_utc']} (medians; kvpool blue, references grey)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=72)
    pyplot.close(figure)

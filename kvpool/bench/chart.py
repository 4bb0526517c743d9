"""The PNG chart of one run: one panel per section, kvpool blue and the references grey, from the
summary that kvpool.bench.report.summarize made of the same results."""

from __future__ import annotations

import pathlib
import statistics

from kvpool.bench.options import as_mib
from kvpool.bench.parallel import CEILING
from kvpool.bench.targets import HOT_PATH_TARGETS, PARALLEL_TARGET
from kvpool.bench.warm import draw_warm


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
         line=(HOT_PATH_TARGETS["daemon_vs_inprocess"] / runtime, f"target {HOT_PATH_TARGETS['daemon_vs_inprocess']}x in-process"))
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
    admissions = [("s5_admit_{}_s", "daemon admit (a released spare) + 1-token append", kvpool)]
    if f"s5_create_admit_{sizes[0]}_s" in summary:  # admissions that create their context (results written since)
        admissions.append(("s5_create_admit_{}_s", "daemon admit creating its context + 1-token append", "#9dc3e6"))
    admissions += [("s5_inprocess_admit_{}_s", "in-process create + append", "#70ad47"), ("s5_bare_create_{}_s", "bare llama context create", reference)]
    narrow = 0.8 / len(admissions)
    for offset, (key, label, color) in enumerate(admissions):
        axes[1][1].bar([i + (offset - (len(admissions) - 1) / 2) * narrow for i in range(len(sizes))], [summary[key.format(n)] * 1e3 for n in sizes], narrow,
                       label=label, color=color)
    axes[1][1].set_xticks(range(len(sizes)), [f"n_ctx {n}" for n in sizes])
    axes[1][1].set_title("5  admission on a warm worker", fontsize=10)
    axes[1][1].set_ylabel("ms")
    axes[1][1].legend(fontsize=8)
    for offset, (key, label, color) in enumerate([("s6_charged_{}_bytes", "charged", kvpool), ("s6_uss_over_start_{}_bytes", "measured USS over start-up", "#70ad47"),
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

"""Section 12's summary (s12_* keys), its headline ratios with their targets and its table rows, from what
kvpool.bench.prefix measured."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.bench.options import as_mib, median_of
from kvpool.bench.prefix import CACHED, COMPONENTS, LLAMA, LLAMA_FRESH, UNCACHED
from kvpool.bench.table import Row, headline, ms, verdict

CACHED_TARGET = 10.0  # uncached time to first token / cached
LLAMA_CPP_TARGET = 0.9  # llama.cpp's time to first token reusing the prefix in one process / kvpool's cached


def _spread(values: Sequence[float]) -> str:
    return f"{ms(median_of(values))} ({ms(min(values))}-{ms(max(values))})"


def _per_daemon(rounds: Sequence[Sequence[float]]) -> str:
    return "/".join(f"{median_of(column) * 1e3:.1f}" for column in zip(*rounds)) + " ms"


def _timing(prefix: dict) -> tuple[dict, dict, list[Row]]:
    runs, system, rest = prefix["runs"], prefix["system_tokens"], prefix["message_tokens"]
    seconds = {name: [one["s"] for one in runs[name]] for name in (CACHED, UNCACHED, LLAMA, LLAMA_FRESH)}
    cached, uncached, llama, fresh = (median_of(seconds[name]) for name in (CACHED, UNCACHED, LLAMA, LLAMA_FRESH))
    speedup, versus, versus_fresh = uncached / cached, llama / cached, fresh / cached
    parts = runs[COMPONENTS]
    first_less_hot_rounds = [[first - hot for first, hot in zip(one["first_append_s"], one["hot_append_s"])] for one in parts]
    total = {key: median_of([one[key] for one in parts]) for key in ("lookup_s", "admit_s", "ahead_wait_s")}
    total |= {key: median_of([sum(one[key]) for one in parts]) for key in ("first_append_s", "hot_append_s")}
    first_less_hot = median_of([sum(one) for one in first_less_hot_rounds])
    steps = total["lookup_s"] + total["admit_s"] + total["ahead_wait_s"] + total["first_append_s"]
    rest_of_cached = cached - steps
    capture = median_of([one["capture_s"] for one in runs[CACHED]])
    llama_restore, llama_rows = (median_of([one[key] for one in runs[LLAMA]]) for key in ("restore_s", "rows_s"))
    create = median_of([one["create_s"] for one in runs[LLAMA_FRESH]])
    summary: dict[str, float | bool] = {}
    for name, key in ((CACHED, "cached"), (UNCACHED, "uncached"), (LLAMA, "llamacpp"), (LLAMA_FRESH, "llamacpp_fresh")):
        summary.update({f"s12_{key}_ttft_s": median_of(seconds[name]), f"s12_{key}_ttft_min_s": min(seconds[name]),
                        f"s12_{key}_ttft_max_s": max(seconds[name])})
    summary.update({
        "s12_cached_vs_uncached": speedup, "s12_vs_llamacpp": versus, "s12_vs_llamacpp_fresh_context": versus_fresh,
        "s12_capture_after_reply_s": capture, "s12_lookup_s": total["lookup_s"], "s12_admit_s": total["admit_s"],
        "s12_restore_ahead_wait_s": total["ahead_wait_s"], "s12_first_append_s": total["first_append_s"],
        "s12_hot_append_s": total["hot_append_s"], "s12_first_less_hot_s": first_less_hot,
        "s12_cached_less_steps_s": rest_of_cached,
        "s12_llamacpp_restore_s": llama_restore, "s12_llamacpp_rows_s": llama_rows, "s12_llamacpp_fresh_create_s": create,
        "s12_llamacpp_prefill_system_s": prefix["reference_prefill_s"], "s12_prefix_state_bytes": prefix["prefix_state_bytes"],
    })
    ratios = {"prefix_cached_vs_uncached_ttft": headline(speedup, CACHED_TARGET), "prefix_vs_llama_cpp_ttft": headline(versus, LLAMA_CPP_TARGET)}
    rounds = len(seconds[CACHED])
    rows = [
        Row("12", f"new session, {system:,}-token system prompt + {rest}-token message, 3 shard daemons, time to first token: the system "
                  f"prompt stored by an earlier session (Router: lookup on each daemon, admission from {system:,} tokens, restore + {rest} rows "
                  f"on each) vs no prefix cache (Router(prefix_cache=False): {system + rest:,} rows prefilled); median (min-max) of {rounds} rounds",
            _spread(seconds[CACHED]), _spread(seconds[UNCACHED]), f"{speedup:.1f}x faster", verdict(speedup, CACHED_TARGET)),
        Row("12", f"the same vs llama.cpp in one process reusing the prefix as its server does: the whole model, {prefix['threads']} thread, one "
                  f"context (n_ctx {prefix['n_ctx']}) kept across requests: llama_memory_seq_rm, llama_state_seq_set_data of the system "
                  f"prompt's saved state ({as_mib(prefix['prefix_state_bytes']):.1f} MiB), the {rest} rows",
            _spread(seconds[CACHED]), f"{_spread(seconds[LLAMA])} (restore {ms(llama_restore)}; {rest} rows {ms(llama_rows)})",
            f"{versus:.2f}x", verdict(versus, LLAMA_CPP_TARGET)),
        Row("12", f"the same vs llama.cpp creating a context per request (llama_init_from_model at n_ctx {prefix['n_ctx']}, then the same)",
            _spread(seconds[CACHED]), f"{_spread(seconds[LLAMA_FRESH])} (context creation {ms(create)})", f"{versus_fresh:.2f}x"),
        Row("12", f"where the cached time goes (a session of its own, step by step as the router takes them; lookup and admission "
                  f"each asked of the 3 daemons at once, the appends summed over them, per daemon after it): lookup "
                  f"{ms(total['lookup_s'])}, admission from the prefix {ms(total['admit_s'])}, first append {ms(total['first_append_s'])} "
                  f"= {rest} rows hot {ms(total['hot_append_s'])} ({_per_daemon([one['hot_append_s'] for one in parts])}) + "
                  f"{ms(first_less_hot)} ({_per_daemon(first_less_hot_rounds)}; the first append minus the same append hot: on the first daemon "
                  f"the restore; each daemon saves the prompt's new block for the store after its reply, beside the next daemon's part); the later "
                  f"daemons restored beside the first's compute (a thread of the router), waited for {ms(total['ahead_wait_s'])} "
                  f"after it; after the replies all 3 held the new block within {ms(capture)}; the cached median less these steps: "
                  f"{ms(rest_of_cached)} (the router's walk of the timed sessions, beside the steps the component session timed apart)",
            ms(steps), f"restore {ms(llama_restore)} + {rest} rows {ms(llama_rows)}",
            f"{rest} rows: {llama_rows / total['hot_append_s']:.2f}x llama.cpp's speed"),
    ]
    return summary, ratios, rows


def _checks(prefix: dict) -> tuple[dict, list[Row]]:
    runs, system = prefix["runs"], prefix["system_tokens"]
    block_count = system // prefix["block"]
    reused = all(one["reused_tokens"] == system and one["hits"] == 1 and not one["fallbacks"] and one["first_append_rows"] == system
                 for one in runs[CACHED])
    reused = reused and not any(one["hits"] for one in runs[UNCACHED])
    reused = reused and all(one["held_blocks"] == block_count and one["admitted"] and all(one["restored"]) for one in runs[COMPONENTS])
    reused = reused and all(memory["reused_tokens"] == memory["sessions"] * system for memory in prefix["memory"].values())
    books = all(state == "ok" for state in prefix["integrity"]) and prefix["sessions_left"] == 0
    books = books and all(not any(memory["sessions_left"]) for memory in prefix["memory"].values())
    first = prefix["first_tokens"]
    identical = all(len(set(tokens)) == 1 for tokens in zip(*first.values()))
    diff = prefix["logits_max_abs_diff_vs_llama_cpp"]
    summary = {"s12_reused_every_round": reused, "s12_first_token_identical": identical, "s12_books_ok": books,
               "s12_cached_logits_max_abs_diff_vs_llamacpp": max(diff[CACHED])}
    rows = [Row("12", f"every cached session started from {system:,} stored tokens on all 3 daemons (router and daemon counts, "
                      "the first daemon's append restored: true, every Restore of the later ones \"restored\"), none uncached did; books ok, no session left", "yes" if reused and books else "NO", "", ""),
            Row("12", "first token identical: cached, uncached, llama.cpp (kept and fresh context), every round; logits max |diff| vs llama.cpp: "
                      + ", ".join(f"{name} {max(values):.3g}" for name, values in diff.items()), "yes" if identical else "NO", "", "")]
    return summary, rows


def _sum(readings: Sequence[dict], key: str) -> int:
    return sum(reading[key] for reading in readings)


def _memory(prefix: dict) -> tuple[dict, dict, list[Row]]:
    memory, sessions = prefix["memory"], 0
    summary: dict[str, float] = {}
    figures = {}
    for mode, one in memory.items():
        sessions = one["sessions"]
        start, seed, held = one["at_start"], one["after_seed"], one["held"]
        figures[mode] = {"reserved": _sum(held, "reserved_bytes") - _sum(seed, "reserved_bytes"),
                         "workers": _sum(held, "workers_uss_bytes"), "workers_growth": _sum(held, "workers_uss_bytes") - _sum(start, "workers_uss_bytes"),
                         "tree": _sum(held, "tree_uss_bytes"), "tree_growth": _sum(held, "tree_uss_bytes") - _sum(start, "tree_uss_bytes"),
                         "store_seed": _sum(seed, "prefix_bytes"), "store_held": _sum(held, "prefix_bytes"),
                         "entries_seed": _sum(seed, "prefix_entries"), "entries_held": _sum(held, "prefix_entries"), "ttft": median_of(one["ttft_s"])}
        summary.update({f"s12_{mode}_{key}_bytes": figures[mode][key] for key in ("reserved", "workers", "workers_growth", "tree", "tree_growth")})
        summary.update({f"s12_{mode}_prefix_store_seed_bytes": figures[mode]["store_seed"], f"s12_{mode}_prefix_store_bytes": figures[mode]["store_held"],
                        f"s12_{mode}_ttft_s": figures[mode]["ttft"]})
    positions = prefix["system_tokens"] + prefix["message_tokens"]
    theory = sessions * positions * sum(prefix["kv_bytes_per_position"])
    prefix_theory = prefix["system_tokens"] * sum(prefix["kv_bytes_per_position"])
    process, batched = figures["process"], figures["batched"]
    ratio = process["reserved"] / batched["reserved"]
    summary.update({"s12_sessions_theoretical_kv_bytes": theory, "s12_prefix_theoretical_kv_bytes": prefix_theory,
                    "s12_memory_process_vs_batched": ratio, "s12_workers_uss_process_vs_batched": process["workers"] / batched["workers"]})
    ratios = {"prefix_memory_process_vs_batched": headline(ratio, None)}
    what = f"{sessions} sessions started from the stored prefix, held at once ({positions:,} positions each), 3 daemons summed, --mode process vs --mode batched"

    def held_and_growth(figure: dict, key: str) -> str:
        return f"{as_mib(figure[key]):.1f} MiB ({as_mib(figure[key + '_growth']):+.1f} since start)"

    rows = [
        Row("12", f"{what}: budget reserved (their theoretical KV {as_mib(theory):.1f} MiB)", f"{as_mib(process['reserved']):.1f} MiB",
            f"{as_mib(batched['reserved']):.1f} MiB", f"{ratio:.2f}x"),
        Row("12", f"{what}: workers' USS (process mode: one worker each; batched: one worker whose context of {sessions} sequences is made at start)",
            held_and_growth(process, "workers"), held_and_growth(batched, "workers"), f"{process['workers'] / batched['workers']:.2f}x"),
        Row("12", f"{what}: the daemons' process trees' USS (supervisors with their prefix stores, workers)", held_and_growth(process, "tree"),
            held_and_growth(batched, "tree"), f"{process['tree'] / batched['tree']:.2f}x"),
        Row("12", f"the prefix stores, 3 daemons summed: after the seed session / with the {sessions} sessions held (each stored its own "
                  f"{positions:,}-token prompt: its block beyond the shared prefix, as a child of the seed's entry; entries: prefixes held; the {prefix['system_tokens']:,}-token prefix's theoretical KV {as_mib(prefix_theory):.1f} MiB)",
            f"{as_mib(process['store_seed']):.1f} MiB ({process['entries_seed']} entries) / {as_mib(process['store_held']):.1f} MiB ({process['entries_held']})",
            f"{as_mib(batched['store_seed']):.1f} MiB ({batched['entries_seed']} entries) / {as_mib(batched['store_held']):.1f} MiB ({batched['entries_held']})", ""),
        Row("12", f"time to first token of those {sessions} sessions (each new, from the stored prefix; median)", ms(process["ttft"]), ms(batched["ttft"]),
            f"{batched['ttft'] / process['ttft']:.2f}x (batched / process)"),
    ]
    return summary, ratios, rows


def summarize_prefix(prefix: dict) -> tuple[dict, dict, list[Row]]:
    """Section 12: its summary (s12_* keys), its ratios with their targets (JSON "ratios") and its table rows."""
    summary, ratios, rows = _timing(prefix)
    checked, check_rows = _checks(prefix)
    memory, memory_ratios, memory_rows = _memory(prefix)
    return {**summary, **checked, **memory}, {**ratios, **memory_ratios}, [*rows, *check_rows, *memory_rows]

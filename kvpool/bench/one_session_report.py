"""The report of sections 1, 2 and 4, one session each (measured by kvpool.bench.one_session): medians,
headline ratios and table rows of the middle shard's decode and prefill, and of greedy decode through the
whole route."""

from __future__ import annotations

from kvpool.bench.checks import slow_reference
from kvpool.bench.one_session import IDLE_CHAIN_S, IDLE_MID_S, RELAY
from kvpool.bench.options import median_of
from kvpool.bench.table import Row, headline, ms, share, verdict
from kvpool.bench.targets import HOT_PATH_TARGETS


def _rate(seconds: float) -> str:
    return f"{1 / seconds:.0f} tok/s ({ms(seconds)})"


def _settings(section: dict) -> str:
    """How many llama threads every computing context of a section ran and the daemons' --keep-warm, as its
    measurement recorded (kvpool.bench.rig; results written before --keep-warm was recorded say nothing of it)."""
    threads = section.get("threads", 1)
    keep_warm = f"; daemons --keep-warm {section['keep_warm_s']:g}" if "keep_warm_s" in section else ""
    return f"{threads} llama thread{'s' if threads != 1 else ''} a context, both sides{keep_warm}"


def summarize_mid_shard(results: dict) -> tuple[dict, dict, list[Row]]:
    """Section 1: the middle shard's decode through a daemon against the same shard in-process, and where
    the daemon's overhead goes."""
    summary: dict[str, float | int | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []

    mid = results["mid_shard"]
    decode = {name: median_of(values) for name, values in mid["decode_s"].items()}
    cold = {name: median_of(values) for name, values in mid.get("cold_decode_s", {}).items() if values}
    mid_trip = median_of(mid["round_trip_s"]["worker_after_idle"])
    mid_trip_hot = median_of(mid["round_trip_s"]["worker"])
    mid_supervisor = median_of(mid["round_trip_s"]["supervisor"])
    overhead = decode["daemon"] - decode["runtime"]
    mid_rest = overhead - mid_trip - mid["payload_s"]
    daemon_vs_runtime = decode["runtime"] / decode["daemon"]
    target = HOT_PATH_TARGETS["daemon_vs_inprocess"]
    ratios["daemon_vs_inprocess"] = headline(daemon_vs_runtime, target)
    summary.update({
        "s1_daemon_decode_s": decode["daemon"], "s1_runtime_decode_s": decode["runtime"], "s1_llamacpp_decode_s": decode["llama.cpp"],
        "s1_daemon_vs_runtime": daemon_vs_runtime, "s1_daemon_vs_llamacpp": decode["llama.cpp"] / decode["daemon"],
        "s1_runtime_vs_llamacpp": decode["llama.cpp"] / decode["runtime"],
        "s1_overhead_s": overhead, "s1_round_trip_after_idle_s": mid_trip, "s1_round_trip_hot_s": mid_trip_hot,
        "s1_round_trip_supervisor_only_s": mid_supervisor, "s1_payload_s": mid["payload_s"], "s1_rest_s": mid_rest,
    })
    summary.update({f"s1_{name.replace('.', '')}_cold_decode_s": seconds for name, seconds in cold.items()})
    relay_rows: list[Row] = []
    if RELAY in decode:  # results without the relay variant: no rows of it
        relay = decode[RELAY]
        summary.update({"s1_relay_decode_s": relay, "s1_relay_vs_runtime": decode["runtime"] / relay, "s1_daemon_vs_relay": relay / decode["daemon"]})
        ratios["mid_relay_vs_inprocess"] = headline(decode["runtime"] / relay)
        ratios["daemon_vs_relay"] = headline(relay / decode["daemon"])
        relay_rows = [
            Row("1", "middle shard decode: the shard in a process with no kvpool code, relayed (kvpool.bench.relay) vs in-process (worker runtime): "
                     "what serving it from another process costs here", _rate(relay), _rate(decode["runtime"]), f"{decode['runtime'] / relay:.3f}x tok/s"),
            Row("1", "middle shard decode: daemon vs that code-free relay: kvpool's own cost", _rate(decode["daemon"]), _rate(relay), f"{relay / decode['daemon']:.3f}x tok/s"),
        ]
    rows += [
        Row("1", f"middle shard decode ({_settings(mid)}): daemon vs the same shard in-process (worker runtime)", _rate(decode["daemon"]), _rate(decode["runtime"]),
            f"{daemon_vs_runtime:.3f}x tok/s", verdict(daemon_vs_runtime, target)),
        Row("1", "middle shard decode: daemon vs llama.cpp in-process, no capture", _rate(decode["daemon"]), _rate(decode["llama.cpp"]),
            f"{decode['llama.cpp'] / decode['daemon']:.3f}x tok/s"),
        Row("1", "middle shard decode: worker runtime (capture, graph stopped) vs llama.cpp, no capture", _rate(decode["runtime"]), _rate(decode["llama.cpp"]),
            f"{decode['llama.cpp'] / decode['runtime']:.3f}x tok/s"),
        *relay_rows,
        *([Row("1", f"  the first step of each turn (the variants take turns every {mid['chunk_steps']} timed steps), right after another "
                     "variant ran; left out of the medians above: daemon vs worker runtime (then llama.cpp's)",
                 ms(cold["daemon"]), f"{ms(cold['runtime'])}; llama.cpp {ms(cold['llama.cpp'])}", f"{cold['runtime'] / cold['daemon']:.3f}x tok/s")]
          if cold else []),
        Row("1", "daemon overhead per token (daemon minus worker runtime)", ms(overhead), "", "100%"),
        Row("1", f"  round trip client-supervisor-worker-back, no compute, after {IDLE_MID_S * 1e3:.0f} ms idle "
                 f"(hot: {ms(mid_trip_hot)}; supervisor only: {ms(mid_supervisor)})", ms(mid_trip), "", share(mid_trip, overhead)),
        Row("1", "  payload: encode, decode, shared-memory copies of one row each way (replayed in-process, hot caches)",
            ms(mid["payload_s"]), "", share(mid["payload_s"], overhead)),
        Row("1", "  rest, not measured apart: the worker's own llama compute of the step against the runtime's, the Python on either side of it, scheduling", ms(mid_rest), "", share(mid_rest, overhead)),
    ]
    return summary, ratios, rows


def summarize_route(results: dict) -> tuple[dict, dict, list[Row]]:
    """Section 2: greedy decode through the 3-shard route against the whole model, and where the
    difference goes."""
    summary: dict[str, float | int | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []

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
    cold = {name: median_of(values) for name, values in route.get("cold_decode_s", {}).items()}  # results before stop 50: none
    slow = slow_reference(whole, local)
    reference = local if slow else whole  # the best the model's computation in one process did here
    summary.update({"s2_sampled_chain_decode_s": sampled, "s2_sampled_chain_vs_whole": whole / sampled, "s2_reference_slow": slow,
                    "s2_route_reference_s": reference})
    ratios["route_vs_whole"] = headline(reference / sampled, HOT_PATH_TARGETS["route_vs_whole"])
    relay_rows: list[Row] = []
    if RELAY in greedy:  # results without the relay variant: no rows of it
        relay = greedy[RELAY]
        summary.update({"s2_relay_decode_s": relay, "s2_relay_vs_whole": reference / relay, "s2_sampled_chain_vs_relay": relay / sampled})
        ratios["route_relay_vs_whole"] = headline(reference / relay)
        ratios["route_vs_relay"] = headline(relay / sampled)
        relay_rows = [
            Row("2", "  the same 3 shards in 3 processes with no kvpool code, relayed, the token picked on the last (kvpool.bench.relay) vs the "
                     "reference above: what any route of processes pays here", _rate(relay), _rate(reference), f"{reference / relay:.3f}x tok/s"),
            Row("2", "  3 shard daemons sampling on the last vs that code-free relay: kvpool's own cost", _rate(sampled), _rate(relay), f"{relay / sampled:.3f}x tok/s"),
        ]
    rows += [
        Row("2", f"greedy decode, one session ({_settings(route)}): 3 shard daemons, the token picked on the last (sampling) vs the whole model in one context"
                 + (" (SLOW here: its 3 shards in one process were faster, and their time is the reference)" if slow else ""),
            _rate(sampled), _rate(reference) + (f"; the whole model in one context {ms(whole)}" if slow else ""), f"{reference / sampled:.3f}x tok/s",
            verdict(reference / sampled, HOT_PATH_TARGETS["route_vs_whole"])),
        *([Row("2", f"  the first step of each turn (the variants take turns every {route['chunk_steps']} timed steps), right after another "
                     "variant ran; left out of the medians above: 3 shard daemons sampling vs the whole model",
                 ms(cold["daemon chain, sampled on the last"]), ms(cold["llama.cpp whole"]),
                 f"{cold['llama.cpp whole'] / cold['daemon chain, sampled on the last']:.3f}x tok/s")]
          if cold else []),
        *relay_rows,
        Row("2", "greedy decode, one session: 3 shard daemons vs the whole model in one llama.cpp context", _rate(chain), _rate(whole), f"{whole / chain:.3f}x tok/s"),
        Row("2", "greedy decode: whole model through 1 daemon vs in one llama.cpp context", _rate(greedy["daemon whole"]), _rate(whole),
            f"{whole / greedy['daemon whole']:.3f}x tok/s"),
        Row("2", "greedy decode: 3 shards in-process (LocalChain) vs the whole model in one context", _rate(local), _rate(whole), f"{whole / local:.3f}x tok/s"),
        Row("2", "where the difference goes (3 daemons minus whole model), per token", ms(difference), "", "100%"),
        Row("2", "  split into 3 contexts in-process: 3 graphs, capture, Python (LocalChain minus whole)", ms(split), "", share(split, difference)),
        Row("2", f"  IPC round trips: 3 x client-supervisor-worker-back after {IDLE_CHAIN_S * 1e3:.0f} ms idle (hot: {ms(trips_hot)})",
            ms(trips), "", share(trips, difference)),
        Row("2", "  payload: 2 hidden-state hops + 192 KiB of logits, encode/decode/copies (replayed in-process, hot caches)", ms(payload), "", share(payload, difference)),
        Row("2", "  rest: append bookkeeping, thread hand-offs, scheduling (daemons minus LocalChain minus the two above)", ms(rest), "", share(rest, difference)),
        Row("2", f"greedy tokens identical in all {len(route['tokens_identical'])} paths", "yes" if summary["s2_tokens_identical"] else "NO", "", ""),
    ]
    return summary, ratios, rows


def summarize_prefill(results: dict) -> tuple[dict, dict, list[Row]]:
    """Section 4: a prefill into the middle shard through a daemon against in-process."""
    prefill = {name: median_of(values) for name, values in results["mid_shard"]["prefill_s"].items()}
    rows_n = results["options"]["prefill_rows"]
    summary = {"s4_daemon_prefill_s": prefill["daemon"], "s4_runtime_prefill_s": prefill["runtime"], "s4_llamacpp_prefill_s": prefill["llama.cpp"]}
    rows = [
        Row("4", f"prefill {rows_n} rows, middle shard: daemon vs in-process (worker runtime)", ms(prefill["daemon"]), ms(prefill["runtime"]),
            f"{prefill['runtime'] / prefill['daemon']:.3f}x tok/s"),
        Row("4", f"prefill {rows_n} rows: daemon vs llama.cpp in-process, no capture, last row out", ms(prefill["daemon"]), ms(prefill["llama.cpp"]),
            f"{prefill['llama.cpp'] / prefill['daemon']:.3f}x tok/s"),
    ]
    if RELAY in prefill:  # results without the relay variant: no rows of it
        summary["s4_relay_prefill_s"] = prefill[RELAY]
        rows.append(Row("4", f"prefill {rows_n} rows: daemon vs the code-free relay (every row's hidden state back)", ms(prefill["daemon"]), ms(prefill[RELAY]),
                        f"{prefill[RELAY] / prefill['daemon']:.3f}x tok/s"))
    return summary, {}, rows

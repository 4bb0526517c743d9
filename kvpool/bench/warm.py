"""Section 7, the warm tier through a 3-daemon route: a parked session's restore against the re-prefill
that a cache miss costs, and how many sessions a GiB holds hot and parked.

The section starts its own three daemons (one per shard of the rig's route) with --n-ctx WARM_N_CTX, so
that a 2048-token session and its decodes fit, and stops them at its end. Its walks go through
kvpool.router.route.Route, which has no recovery: a cache miss raises instead of being replayed silently, so
a "restore" timed here is never a re-prefill in disguise.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Sequence

import numpy as np

from kvpool.bench.options import (
    EPOCH,
    LOADED_CYCLES,
    PARK_CYCLES,
    REQUEST_CYCLES,
    WARM_DECODE_POSITIONS,
    WARM_N_CTX,
    BenchOptions,
    as_mib,
    bench_say,
    median_of,
)
from kvpool.bench.rig import PROMPTS, long_history, run_interleaved, start_daemons, time_call
from kvpool.bench.table import Row, headline, ms, verdict
from kvpool.client.client import Client
from kvpool.local.tokenizer import Tokenizer
from kvpool.router.route import Route
from kvpool.shard.header import ShardInfo
from kvpool.wire.protocol import StatsReply
from workers.server.single import IDLE_ZERO_S

WARM_SESSIONS = 2  # workers per daemon: the parked session's restore and a fresh session never wait for one
PARKED_TOKENS = 256
PARKED_N_CTX = 2048
RESTORE_TARGET = 100.0  # (prefill + decode of a fresh session) / (Park answered + the decode that restores): issue 29's
RESTORE_TARGET_LENGTH = 512
CYCLE_KINDS = ("", "request_", "loaded_")  # the prefixes of each kind's keys (options.PARK_CYCLES, REQUEST_CYCLES, LOADED_CYCLES)
FIRST_LOADED = PARK_CYCLES + REQUEST_CYCLES  # the cycle whose decode's logits the re-prefill's are compared with (`loaded_logits`)
SETTLE_S = IDLE_ZERO_S + 0.3
PARKED_TARGET = 20.0  # parked sessions per GiB / hot sessions per GiB
GIB = 1024**3


# ---- measurement --------------------------------------------------------------------------------------


def _counters(clients: Sequence[Client], name: str) -> list[int]:
    return [client.stats().counters.get(name, 0) for client in clients]


def _row(stats: StatsReply, session: str):
    return next(row for row in stats.sessions if row.session_id == session)


def _cycle_kind(cycle: int) -> str:
    """The decode restoring ("") and Restore first ("request_") take turns, so the two kinds share the round's
    drift (a store that grows, the host's hour); then the LOADED_CYCLES ("loaded_")."""
    if cycle >= FIRST_LOADED:
        return "loaded_"
    return "" if cycle % 2 == 0 else "request_"


def _restore_once(route: Route, session: str, tokens: list[int], length: int) -> dict:
    """Prefill (not timed), then PARK_CYCLES + REQUEST_CYCLES + LOADED_CYCLES times (_cycle_kind): time Park on every
    daemon at once (kvpool.router.route.Route.park) answered once each save has begun (Park.wait false: the save
    finishes behind the reply), then a waiting Park on every daemon (answered "already parked" once that daemon's
    state is in its store: the time from the first park's start to its answer bounds when the saves were done), then
    the 1-token decode that restores on each daemon in turn (in the last LOADED_CYCLES after SETTLE_S idle, untimed),
    or in the REQUEST_CYCLES Restore on every daemon at once (kvpool.router.route.Route.restore; `request_call_s` the
    Restore alone; each daemon must answer "restored" with its direct channel) and then the decode; then one more
    decode (hot again). So the restore is timed with every save done, as when a session comes back. Lists of the
    cycles' times by kind (CYCLE_KINDS: the keys' prefix), and per cycle whether each daemon's restore resumed its
    spare's cells; `logits` the first restoring decode's and `loaded_logits` the first loaded one's (the re-prefill
    decodes the same tokens at the same positions)."""
    clients = route.clients
    route.append(session, EPOCH, 0, tokens[:length])
    got: dict = {f"{kind}{name}": [] for kind in CYCLE_KINDS for name in ("park_s", "saved_s", "restore_s", "in_place")}
    got |= {"request_call_s": [], "hot_decode_s": [], "restored_everywhere": True}
    for cycle in range(FIRST_LOADED + LOADED_CYCLES):
        kind = _cycle_kind(cycle)
        at = length + 2 * cycle
        started = time.perf_counter()
        answered = route.park(session, EPOCH, wait=False)  # every daemon at once, as a router parks a route
        got[f"{kind}park_s"].append(time.perf_counter() - started)
        stored = route.park(session, EPOCH)
        got[f"{kind}saved_s"].append(time.perf_counter() - started)
        parked = all(_row(client.stats(), session).tier != "hot" for client in clients)
        parked = parked and [done.detail for done in answered] == ["parking"] * len(clients)
        parked = parked and [done.detail for done in stored] == ["already parked"] * len(clients)
        restores, misses, in_place = (_counters(clients, name) for name in ("restores", "misses", "restores_in_place"))
        if kind == "loaded_":
            time.sleep(SETTLE_S)
        started = time.perf_counter()
        if kind == "request_":
            restored_answers = route.restore(session, EPOCH)  # every daemon at once, as a router restores a route it parked
            got["request_call_s"].append(time.perf_counter() - started)
            parked = parked and all(done.detail == "restored" and done.channel for done in restored_answers)
        logits = route.append(session, EPOCH, at, tokens[at : at + 1])
        got[f"{kind}restore_s"].append(time.perf_counter() - started)
        restored = [after - before for after, before in zip(_counters(clients, "restores"), restores)] == [1] * len(clients)
        got[f"{kind}in_place"].append([after - before == 1 for after, before in zip(_counters(clients, "restores_in_place"), in_place)])
        got["restored_everywhere"] = got["restored_everywhere"] and parked and restored and _counters(clients, "misses") == misses
        hot = time_call(lambda at=at: route.append(session, EPOCH, at + 1, tokens[at + 1 : at + 2]))
        if not kind:
            got["hot_decode_s"].append(hot)
        if cycle in (0, FIRST_LOADED):
            got["loaded_logits" if kind == "loaded_" else "logits"] = logits
    route.release(session, EPOCH)
    return got


def _reprefill_once(route: Route, session: str, tokens: list[int], length: int) -> dict:
    """What a cache miss costs: a fresh session's prefill of the same tokens, then the same decode (timed); then,
    untimed, the decodes the restored session made up to its first loaded cycle's, whose logits that one's are
    compared with."""
    started = time.perf_counter()
    route.append(session, EPOCH, 0, tokens[:length])
    prefill_s = time.perf_counter() - started
    logits = route.append(session, EPOCH, length, tokens[length : length + 1])
    total_s = time.perf_counter() - started
    loaded_at = length + 2 * FIRST_LOADED
    for at in range(length + 1, loaded_at + 1):
        loaded_logits = route.append(session, EPOCH, at, tokens[at : at + 1])
    route.release(session, EPOCH)
    return {"prefill_s": prefill_s, "total_s": total_s, "logits": logits, "loaded_logits": loaded_logits}


CYCLE_KEYS = tuple(f"{kind}{name}" for kind in CYCLE_KINDS for name in ("park_s", "saved_s", "restore_s", "in_place")) + (
    "request_call_s", "hot_decode_s")


def _measure_length(route: Route, tokens: list[int], length: int, repeats: int) -> dict:
    runs: dict[str, list] = {key: [] for key in (*CYCLE_KEYS, "reprefill_prefill_s", "reprefill_s", "restored_everywhere", "logits_identical")}
    for round_index, order in run_interleaved(repeats, ["restore", "re-prefill"]):
        logits = {}
        for name in order:
            session = f"bench-warm-{length}-{round_index}-{name}"
            if name == "restore":
                got = _restore_once(route, session, tokens, length)
                for key in CYCLE_KEYS:
                    runs[key].extend(got[key])
                runs["restored_everywhere"].append(got["restored_everywhere"])
            else:
                got = _reprefill_once(route, session, tokens, length)
                runs["reprefill_prefill_s"].append(got["prefill_s"])
                runs["reprefill_s"].append(got["total_s"])
            logits[name] = {key: got[key] for key in ("logits", "loaded_logits")}
        runs["logits_identical"].append(all(np.array_equal(logits["restore"][key], logits["re-prefill"][key]) for key in ("logits", "loaded_logits")))
        bench_say(f"warm tier: {length} tokens, round {round_index + 1}/{repeats}")
    return runs


def _parked_vs_hot(route: Route, tokens: list[int], kv_bytes_per_position: list[int]) -> dict:
    """One PARKED_TOKENS-token session of n_ctx PARKED_N_CTX: its charge on each daemon while hot, and the
    spill-store bytes it takes on each once parked."""
    clients, session = route.clients, "bench-warm-memory"
    spill_before = [client.stats().budget.spill_bytes for client in clients]
    route.append(session, EPOCH, 0, tokens[:PARKED_TOKENS], n_ctx=PARKED_N_CTX)
    hot = [_row(client.stats(), session).charged_bytes for client in clients]
    for client in clients:
        client.park(session, EPOCH)
    after = [client.stats() for client in clients]
    tiers = [_row(stats, session).tier for stats in after]
    route.release(session, EPOCH)
    return {
        "tokens": PARKED_TOKENS, "n_ctx": PARKED_N_CTX, "hot_bytes_per_daemon": hot, "tiers_after_park": tiers,
        "parked_bytes_per_daemon": [stats.budget.spill_bytes - before for stats, before in zip(after, spill_before)],
        "theoretical_kv_bytes_per_daemon": [PARKED_TOKENS * per_position for per_position in kv_bytes_per_position],
    }


def measure_warm(shards: Sequence[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions) -> dict:
    common = ["--ttl", "600", "--threads-per-worker", "1", "--threads", "1", "--max-sessions", str(WARM_SESSIONS),
              "--n-ctx", str(WARM_N_CTX), "--budget", "1GiB", "--spill-budget", "1GiB"]
    plan = {f"warm{index}": (shard.path, common) for index, shard in enumerate(shards)}
    prompt = tokenizer.encode(tokenizer.chat_prompt(PROMPTS[0]))
    tokens = long_history(tokenizer, prompt, max(*options.warm_lengths, PARKED_TOKENS) + WARM_DECODE_POSITIONS)
    with contextlib.ExitStack() as stack:
        bench_say(f"warm tier: starting {len(plan)} daemons (--n-ctx {WARM_N_CTX}, --max-sessions {WARM_SESSIONS})")
        started = time.perf_counter()
        daemons = start_daemons(plan, socket_dir, stack)
        start_s = time.perf_counter() - started
        clients = [stack.enter_context(Client(daemon.socket, name="kvpool-bench")) for daemon in daemons.values()]
        route = Route(clients)
        smallest = min(options.warm_lengths)
        _restore_once(route, "bench-warm-warm-up-restore", tokens, smallest)  # first contexts, saves and restores allocate
        _reprefill_once(route, "bench-warm-warm-up-re-prefill", tokens, smallest)
        lengths = {length: _measure_length(route, tokens, length, options.warm_repeats) for length in options.warm_lengths}
        memory = _parked_vs_hot(route, tokens, [_kv_bytes_per_position(client) for client in clients])
        integrity = [client.stats().integrity for client in clients]
    bench_say("warm tier done")
    return {"daemon_options": common, "daemon_start_s": start_s, "lengths": lengths, "parked_vs_hot": memory, "integrity": integrity}


def _kv_bytes_per_position(client: Client) -> int:
    """f16 K and V of the daemon's layers per cached position, from its calibration rows (theoretical bytes at n_ctx)."""
    row = client.stats().calibration[0]
    return row.theoretical_kv_bytes // row.n_ctx


# ---- report -------------------------------------------------------------------------------------------


def summarize_warm(warm: dict) -> tuple[dict, dict, list[Row]]:
    """Section 7's summary (s7_* keys), its ratios with their targets (JSON "ratios"), and its table rows."""
    summary: dict[str, float | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []
    checks = True
    in_place = loaded_in_place = cycles = loaded_cycles = 0
    for key, runs in warm["lengths"].items():
        length = int(key)
        park, restore, hot = (median_of(runs[name]) for name in ("park_s", "restore_s", "hot_decode_s"))
        parked_and_restored = median_of([a + b for a, b in zip(runs["park_s"], runs["restore_s"])])
        # what a caller that waited for the saves would have paid: the saves done (bounded by the waiting Park's
        # answer, one round trip over) + the restoring decode
        saved = median_of(runs["saved_s"])
        saved_and_restored = median_of([a + b for a, b in zip(runs["saved_s"], runs["restore_s"])])
        loaded_park, loaded_restore = median_of(runs["loaded_park_s"]), median_of(runs["loaded_restore_s"])
        loaded = median_of([a + b for a, b in zip(runs["loaded_park_s"], runs["loaded_restore_s"])])
        request_park, request_call, request_restore = (median_of(runs[name]) for name in ("request_park_s", "request_call_s", "request_restore_s"))
        request_total = median_of([a + b for a, b in zip(runs["request_park_s"], runs["request_restore_s"])])
        reprefill = median_of(runs["reprefill_s"])
        ratio = reprefill / parked_and_restored
        target = RESTORE_TARGET if length == RESTORE_TARGET_LENGTH else None
        ratios[f"restore_vs_reprefill_{length}"] = headline(ratio, target)
        summary.update({f"s7_park_{length}_s": park, f"s7_restore_decode_{length}_s": restore, f"s7_hot_decode_{length}_s": hot,
                        f"s7_park_and_restore_{length}_s": parked_and_restored, f"s7_reprefill_{length}_s": reprefill,
                        f"s7_restore_vs_reprefill_{length}": ratio, f"s7_restore_decode_vs_reprefill_{length}": reprefill / restore,
                        f"s7_request_park_{length}_s": request_park, f"s7_request_call_{length}_s": request_call,
                        f"s7_request_restore_decode_{length}_s": request_restore, f"s7_request_park_and_restore_{length}_s": request_total,
                        f"s7_request_restore_vs_reprefill_{length}": reprefill / request_total,
                        f"s7_loaded_park_{length}_s": loaded_park, f"s7_loaded_restore_decode_{length}_s": loaded_restore,
                        f"s7_loaded_park_and_restore_{length}_s": loaded, f"s7_loaded_restore_vs_reprefill_{length}": reprefill / loaded,
                        f"s7_loaded_restore_decode_vs_reprefill_{length}": reprefill / loaded_restore,
                        f"s7_saved_{length}_s": saved, f"s7_saved_and_restore_{length}_s": saved_and_restored,
                        f"s7_saved_and_restore_vs_reprefill_{length}": reprefill / saved_and_restored,
                        f"s7_loaded_saved_{length}_s": median_of(runs["loaded_saved_s"])})
        checks = checks and all(runs["restored_everywhere"]) and all(runs["logits_identical"])
        # the path each daemon's restore took: its own park's cells resumed (right after), the state loaded (after the idle)
        right_after = runs["in_place"] + runs["request_in_place"]
        in_place, cycles = in_place + sum(map(sum, right_after)), cycles + sum(map(len, right_after))
        loaded_in_place, loaded_cycles = loaded_in_place + sum(map(sum, runs["loaded_in_place"])), loaded_cycles + sum(map(len, runs["loaded_in_place"]))
        counted = f"{len(runs['park_s'])} cycles, {PARK_CYCLES} per round, taking turns with the next row's"
        rows.append(Row("7", f"{length}-token session, 3 daemons: Park on all at once, answered once each save has begun (Park.wait false), + "
                             f"the 1-token decode that restores on each once the saves are done (in place: the cells each park left; medians of "
                             f"{counted}) vs a fresh session's prefill + the same decode (re-prefill: a cache miss)",
                        f"{ms(parked_and_restored)} (park {ms(park)}; restoring decode {ms(restore)}, {reprefill / restore:.1f}x faster alone; "
                        f"then a hot decode {ms(hot)})",
                        f"{ms(reprefill)} (prefill {ms(median_of(runs['reprefill_prefill_s']))})", f"{ratio:.1f}x faster",
                        "" if target is None else verdict(ratio, target)))
        rows.append(Row("7", f"{length}-token session, the same with Restore on all at once before the decode (kvpool.router.route.Route.restore: "
                             f"answered once each daemon holds the session hot again, its direct channel bound; medians of "
                             f"{len(runs['request_park_s'])} cycles, {REQUEST_CYCLES} per round)",
                        f"{ms(request_total)} (park {ms(request_park)}; Restore {ms(request_call)}; Restore + decode {ms(request_restore)}, "
                        f"{reprefill / request_restore:.1f}x faster alone)",
                        f"{ms(reprefill)}", f"{reprefill / request_total:.1f}x faster", ""))
        rows.append(Row("7", f"{length}-token session, the same for a caller that waits for the saves: from the park's start until a waiting Park "
                             "on every daemon answered (its state in the store), + the restoring decode",
                        f"{ms(saved_and_restored)} (saves done within {ms(saved)})", f"{ms(reprefill)}",
                        f"{reprefill / saved_and_restored:.1f}x faster", ""))
        rows.append(Row("7", f"{length}-token session, the same with the restore {SETTLE_S:.1f} s after the park (the workers idle: their "
                             f"spares zeroed, the state loaded from the store; medians of {len(runs['loaded_park_s'])} cycles, {LOADED_CYCLES} per round)",
                        f"{ms(loaded)} (park {ms(loaded_park)}; restoring decode {ms(loaded_restore)}, {reprefill / loaded_restore:.1f}x faster alone)",
                        f"{ms(reprefill)}", f"{reprefill / loaded:.1f}x faster", ""))
    summary["s7_restored_exactly"] = checks
    summary.update({"s7_restores_in_place": in_place, "s7_restores_right_after": cycles,
                    "s7_loaded_restores_in_place": loaded_in_place, "s7_restores_after_idle": loaded_cycles})
    rows.append(Row("7", f"restores that resumed their own park's cells (Restored.in_place), of the daemons' restores right after the park / "
                         f"{SETTLE_S:.1f} s after it (a worker busy past IDLE_ZERO_S may still resume in place)",
                    f"{in_place} of {cycles}", f"{loaded_in_place} of {loaded_cycles}", "", ""))
    rows.append(Row("7", "every timed cycle restored on all 3 daemons (no miss; every Restore answered \"restored\"); the first decode's logits "
                         "after a restore, in place and loaded, bit-identical to the re-prefilled session's at the same position",
                    "yes" if checks else "NO", "", ""))

    memory = warm["parked_vs_hot"]
    hot, parked = sum(memory["hot_bytes_per_daemon"]), sum(memory["parked_bytes_per_daemon"])
    theory = sum(memory["theoretical_kv_bytes_per_daemon"])
    ratio = hot / parked
    ratios["parked_vs_hot_sessions_per_gib"] = headline(ratio, PARKED_TARGET)
    summary.update({"s7_hot_session_bytes": hot, "s7_parked_session_bytes": parked, "s7_theoretical_kv_bytes": theory,
                    "s7_hot_sessions_per_gib": GIB / hot, "s7_parked_sessions_per_gib": GIB / parked, "s7_parked_vs_hot_sessions_per_gib": ratio})
    rows.append(Row("7", f"sessions per GiB, {memory['tokens']} tokens at n_ctx {memory['n_ctx']}, summed over 3 daemons: parked (spill bytes; "
                         f"theoretical KV {as_mib(theory):.2f} MiB) vs hot (charged bytes; per daemon "
                         + " / ".join(f"{as_mib(value):.1f}" for value in memory["hot_bytes_per_daemon"]) + " MiB)",
                    f"{GIB / parked:.0f} ({as_mib(parked):.2f} MiB each)", f"{GIB / hot:.1f} ({as_mib(hot):.1f} MiB each)",
                    f"{ratio:.1f}x sessions", verdict(ratio, PARKED_TARGET)))
    return summary, ratios, rows


def draw_warm(restore_axis, memory_axis, summary: dict, lengths: Sequence[int]) -> None:
    """Section 7's two panels of the chart (matplotlib axes)."""
    positions = np.arange(len(lengths))
    for offset, (key, label, color) in enumerate([("s7_park_and_restore_{}_s", "park + restoring decode", "#4472c4"),
                                                  ("s7_reprefill_{}_s", "re-prefill + decode", "#a5a5a5")]):
        restore_axis.bar(positions + (offset - 0.5) * 0.4, [summary[key.format(n)] * 1e3 for n in lengths], 0.4, label=label, color=color)
    restore_axis.set_yscale("log")
    restore_axis.set_xticks(list(positions), [f"{n} tokens" for n in lengths])
    restore_axis.set_title("7  warm tier: restore vs re-prefill, 3 daemons", fontsize=10)
    restore_axis.set_ylabel("ms (log)")
    restore_axis.legend(fontsize=8)
    values = [summary["s7_parked_sessions_per_gib"], summary["s7_hot_sessions_per_gib"]]
    memory_axis.bar([0, 1], values, color=["#4472c4", "#a5a5a5"])
    memory_axis.set_yscale("log")
    memory_axis.set_xticks([0, 1], ["parked", "hot"])
    for position, value in enumerate(values):
        memory_axis.annotate(f"{value:.3g}", (position, value), ha="center", va="bottom", fontsize=8)
    memory_axis.set_title(f"7  sessions per GiB, {PARKED_TOKENS} tokens, n_ctx {PARKED_N_CTX}", fontsize=10)
    memory_axis.set_ylabel("sessions (log)")

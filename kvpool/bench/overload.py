"""Section 7: overload. Eight sessions through a chain of 3 shard daemons with 2 places each, all at once
(the daemons queue, protect and evict: kvpool.daemon.admission.queue, kvpool.daemon.admission.residency), against the same eight
sessions run 2 at a time by the router (no session ever waits or is evicted: the best any scheduler could
do with 2 places). Each session: its prompt, then `steps` greedy decode steps through kvpool.router.router, then
release. Throughput is the sessions' decoded tokens over the wall time from the common start to the last
finish; variants alternate round by round on the same daemons; the ratio of medians is the figure.

Both are measured with the warm tier on (the daemons' default: an evicted session is parked and restored
instead of replayed) and off (--spill-budget 0), each on its own chain; whether the daemons really have the
tier is read from their stats (a spill store) and reported with the ratio. The target applies with the tier.
"""

from __future__ import annotations

import pathlib
import queue
import threading
import time
from collections.abc import Sequence

from kvpool.bench.options import median_of
from kvpool.bench.rig import run_interleaved
from kvpool.bench.table import Row, headline
from kvpool.client.client import Client
from kvpool.launcher import Daemon
from kvpool.local.tokenizer import Tokenizer
from kvpool.router.router import RecoveryPolicy, Router

OVERLOAD_SESSIONS = 8
PLACES = 2
OVERLOAD_N_CTX = 512
OVERLOAD_TARGET = 0.8  # 8 sessions on 2 places >= 0.8 x the same sessions 2 at a time (with the warm tier)
ALL_AT_ONCE = f"{OVERLOAD_SESSIONS} sessions at once on {PLACES} places per daemon"
TWO_AT_A_TIME = f"the same {OVERLOAD_SESSIONS} sessions, {PLACES} at a time by the router"
ADMIT_TIMEOUT_S = 60.0
POLICY = RecoveryPolicy(max_replays=100, over_budget_give_up_s=1800.0)
TIER_ON = "warm tier on"
TIERS = {TIER_ON: ("on", []), "warm tier off": ("off", ["--spill-budget", "0"])}  # name: (socket tag, extra daemon options)
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List four fruits.",
    "Why is the sky blue? Answer briefly.",
    "Explain what a hash table is to a ten year old.",
    "Give three tips for writing clear commit messages.",
    "Translate 'good morning' into Spanish and French.",
    "Describe the water cycle in two sentences.",
)


def _run_session(clients: Sequence[Client], name: str, prompt: Sequence[int], steps: int) -> tuple[list[int], dict[str, int]]:
    session = Router(clients, policy=POLICY).session(name, n_ctx=OVERLOAD_N_CTX, admit_timeout_s=ADMIT_TIMEOUT_S)
    try:
        tokens = list(session.greedy(prompt, steps))
    finally:
        session.release()
    counts = session.counts
    return tokens, {"replays": counts.replays, "replayed_tokens": counts.replayed_tokens, "over_budget_retries": counts.over_budget_retries}


def _run(sockets: Sequence[pathlib.Path], prompts: Sequence[Sequence[int]], steps: int, concurrency: int, tag: str) -> dict:
    """Every session once, `concurrency` at a time (each runner thread takes the next session in order)."""
    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(prompts)):
        todo.put(index)
    tokens: list[list[int]] = [[] for _ in prompts]
    counts: list[dict[str, int]] = [{} for _ in prompts]
    errors: list[BaseException] = []
    barrier = threading.Barrier(concurrency + 1)

    def runner() -> None:
        clients = [Client(path, name=f"bench-overload-{tag}") for path in sockets]
        try:
            barrier.wait()
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                tokens[index], counts[index] = _run_session(clients, f"overload-{tag}-{index}", prompts[index], steps)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)
            barrier.abort()
        finally:
            for client in clients:
                client.close()

    threads = [threading.Thread(target=runner, name=f"bench-overload-{tag}-{index}") for index in range(concurrency)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return {"wall_s": wall, "tokens_per_s": len(prompts) * steps / wall, "tokens": tokens,
            **{key: sum(c.get(key, 0) for c in counts) for key in ("replays", "replayed_tokens", "over_budget_retries")}}


def _counters(sockets: Sequence[pathlib.Path]) -> list[dict[str, int]]:
    counters = []
    for path in sockets:
        with Client(path, name="bench-overload-stats") as client:
            counters.append(dict(client.stats().counters))
    return counters


def _warm_tier_on(sockets: Sequence[pathlib.Path]) -> bool:
    """Every daemon has a spill store (a daemon without the warm tier reports none)."""
    limits = []
    for path in sockets:
        with Client(path, name="bench-overload-stats") as client:
            limits.append(client.stats().budget.spill_limit_bytes)
    return all(limit > 0 for limit in limits)


def _measure_chain(shard_paths: Sequence[pathlib.Path], prompts: list[list[int]], socket_dir: pathlib.Path, extra: list[str], tag: str, *, steps: int, rounds: int, say) -> dict:
    """Both variants, alternating round by round, on one chain of daemons (started and stopped here)."""
    options = ["--threads", "1", "--threads-per-worker", "1", "--n-ctx", str(OVERLOAD_N_CTX), "--max-sessions", str(PLACES), "--ttl", "600", *extra]
    daemons = [Daemon(path, socket_dir / f"overload-{tag}{index}.sock", options) for index, path in enumerate(shard_paths)]
    try:
        for daemon in daemons:
            daemon.wait_ready()
        sockets = [daemon.socket for daemon in daemons]
        variants = {ALL_AT_ONCE: OVERLOAD_SESSIONS, TWO_AT_A_TIME: PLACES}
        rates: dict[str, list[float]] = {name: [] for name in variants}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        deltas: list[dict[str, int]] = []
        for round_index, names in run_interleaved(rounds, list(variants)):
            for name in names:
                before = _counters(sockets)
                result = _run(sockets, prompts, steps, variants[name], f"{tag}-{round_index}-{variants[name]}")
                after = _counters(sockets)
                if name == ALL_AT_ONCE:
                    deltas.append({key: sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before)) for key in after[0]})
                rates[name].append(result["tokens_per_s"])
                runs[name].append(result)
                say(f"overload ({tag}) round {round_index}: {name}: {result['tokens_per_s']:.1f} tok/s ({result['wall_s']:.1f} s)")
        return {
            "tokens_per_s": rates, "warm_tier": _warm_tier_on(sockets), "tokens": [run["tokens"] for name in variants for run in runs[name]],
            "all_at_once": {key: [run[key] for run in runs[ALL_AT_ONCE]] for key in ("replays", "replayed_tokens", "over_budget_retries")},
            "daemon_counters_all_at_once": deltas, "daemon_options": options,
            "min_residency_ms": [counters.get("min_residency_ms", 0) for counters in _counters(sockets)],
        }
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def measure_overload(shard_paths: Sequence[pathlib.Path], tokenizer: Tokenizer, socket_dir: pathlib.Path, *, steps: int, rounds: int, say) -> dict:
    """Section 7: the two variants with the warm tier on (the daemons' default) and off (--spill-budget 0)."""
    prompts = [tokenizer.encode(tokenizer.chat_prompt(text)) for text in PROMPTS[:OVERLOAD_SESSIONS]]
    chains = {name: _measure_chain(shard_paths, prompts, socket_dir, extra, tag, steps=steps, rounds=rounds, say=say) for name, (tag, extra) in TIERS.items()}
    every = [tokens for chain in chains.values() for tokens in chain.pop("tokens")]
    return {"steps": steps, "tokens_identical": all(tokens == every[0] for tokens in every), "chains": chains}


def summarize_overload(results: dict) -> tuple[dict, dict, list[Row]]:
    """Summary figures, the JSON's headline ratio and the table rows of section 8."""
    summary: dict = {"s8_tokens_identical": results["tokens_identical"]}
    ratios: dict = {}
    rows = []
    for name, chain in results["chains"].items():
        key = "" if name == TIER_ON else "_tier_off"
        rates = {variant: median_of(values) for variant, values in chain["tokens_per_s"].items()}
        ratio = rates[ALL_AT_ONCE] / rates[TWO_AT_A_TIME]
        deltas = chain["daemon_counters_all_at_once"]
        moved = {counter: median_of([d.get(counter, 0) for d in deltas]) for counter in ("evictions", "spills", "restores", "admissions_queued")}
        replays = median_of(chain["all_at_once"]["replays"])
        summary.update({f"s8_all_at_once{key}_tok_s": rates[ALL_AT_ONCE], f"s8_two_at_a_time{key}_tok_s": rates[TWO_AT_A_TIME], f"s8_ratio{key}": ratio,
                        f"s8_warm_tier{key}": chain["warm_tier"]})
        spread = {variant: f" (rounds {min(values):.1f}-{max(values):.1f})" for variant, values in chain["tokens_per_s"].items()}
        actual = "on" if chain["warm_tier"] else "off or absent"
        target = f">= {OVERLOAD_TARGET:.2f}: {'met' if ratio >= OVERLOAD_TARGET else 'MISSED'}" if name == TIER_ON and chain["warm_tier"] else "(tier off: no target)"
        if name == TIER_ON and chain["warm_tier"]:
            ratios["overload_vs_two_at_a_time"] = headline(ratio, OVERLOAD_TARGET)
        rows += [
            Row("8", f"overload, {name} (the daemons report it {actual}): decode throughput, {ALL_AT_ONCE} vs {TWO_AT_A_TIME} ({results['steps']} steps each)",
                f"{rates[ALL_AT_ONCE]:.1f} tok/s{spread[ALL_AT_ONCE]}", f"{rates[TWO_AT_A_TIME]:.1f} tok/s{spread[TWO_AT_A_TIME]}", f"{ratio:.3f}x tok/s", target),
            Row("8", f"  all at once, per round (medians over 3 daemons): evictions {moved['evictions']:g}, parked {moved['spills']:g}, restored {moved['restores']:g}, "
                     f"admissions that waited in line {moved['admissions_queued']:g}, router replays {replays:g}; min residency {chain['min_residency_ms']} ms", "", "", ""),
        ]
    rows.append(Row("8", "greedy tokens identical, all at once and 2 at a time, tier on and off", "yes" if results["tokens_identical"] else "NO", "", ""))
    return summary, ratios, rows

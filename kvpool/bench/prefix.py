"""Section 12, shared prefixes (issue 28): a new session whose prompt is a system prompt of
BenchOptions.prefix_system_tokens tokens (1,024; 512 in the quick run) and a MESSAGE_TOKENS-token message,
through the 3-shard route (3 daemons of its own, process mode, --n-ctx
PREFIX_N_CTX, the default --prefix-block), timed to its first token (the first append's logits):

  cached     Router(clients): the system prompt already stored on every daemon by an earlier session; the
             router looks the prompt's blocks up and admits the session from the blocks all of them hold, each
             step on every daemon at once, and the walk computes only the message (the first daemon restores
             the session with its rows, the later ones meanwhile)
  uncached   Router(clients, prefix_cache=False): the whole prompt prefilled through the 3 daemons
  llama.cpp  the whole model in this process, 1 thread (each daemon runs 1), one context kept across requests
             as llama.cpp's server keeps its slot's: llama_memory_seq_rm, llama_state_seq_set_data of the system
             prompt's saved state (saved once, untimed, kept in native memory as the server's prompt cache keeps
             it), then the message; also with a context created per request (llama_init_from_model, then the same)

and where the cached time goes: one more new session, taken step by step as the router takes it and timed
apart (its lookup and prefix admission, each on every daemon at once; its first append on each daemon, which
restores it on the first daemon while the later ones restore it beside that compute and computes the message,
each daemon saving the prompt's new block for the store after its reply; and the same append again hot).
Each round is a new session of every variant, its message tokens its own (distinct in every round; the
variants of one round share theirs, so their first tokens are compared); the variants alternate their order
round by round. A cached session's prefill completes blocks its daemons do not hold, so each saves its state for
the store right after its reply: the round waits until every daemon answers for them (timed, `capture_s`) before
the next variant runs.

Memory: SESSIONS sessions started from the stored prefix and held at once, on 3 daemons of each mode (process:
one worker per session; batched: the sessions as sequences of one worker's context): what the daemons measure
(budget reserved, workers' USS, the process tree's USS) and the prefix store's bytes, after the seed and with
the sessions held. The section stops every daemon it starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import pathlib
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.bench.options import EPOCH, PREFIX_N_CTX, SESSIONS, SINGLE_THREADS, BenchOptions
from kvpool.bench.reference import PlainContext
from kvpool.bench.rig import FILLER_TEXT, daemon_uss, run_interleaved, start_daemons, time_call
from kvpool.client.client import Client
from kvpool.launcher import Daemon
from kvpool.local.tokenizer import Tokenizer
from kvpool.router.prefix import PrefixChain, RestoringAhead, admit_everywhere, held_everywhere
from kvpool.router.route import Route
from kvpool.router.router import Router
from kvpool.shard.header import ShardInfo, file_sha256
from kvpool.wire.prefix import chain_digests
from workers.runtime.model import ShardModel

MESSAGE_TOKENS = 32
SYSTEM_TEXT = "You are a careful assistant. Answer briefly, cite what you were given, and say so when you do not know. "
STORE_HANG_GUARD_S = 600.0  # a hang guard for a prefill's background store, never a verdict on speed
COMMON = ["--threads", "1", "--threads-per-worker", "1", "--ttl", "3600", "--n-ctx", str(PREFIX_N_CTX)]
DAEMON_OPTIONS = [*COMMON, "--max-sessions", "2"]
MEMORY_OPTIONS = {
    "process": [*COMMON, "--max-sessions", str(SESSIONS), "--budget", "2GiB"],
    "batched": [*COMMON, "--max-sessions", str(SESSIONS), "--budget", "2GiB", "--mode", "batched", "--seqs-per-worker", str(SESSIONS)],
}
CACHED, UNCACHED, LLAMA, LLAMA_FRESH, COMPONENTS = "cached", "uncached", "llama.cpp", "llama.cpp fresh context", "components"
VARIANTS = (CACHED, UNCACHED, LLAMA, LLAMA_FRESH, COMPONENTS)


# ---- inputs -------------------------------------------------------------------------------------------


def system_prompt(tokenizer: Tokenizer, length: int) -> list[int]:
    """`length` tokens: SYSTEM_TEXT, then the bench's filler text."""
    filler = tokenizer.encode(FILLER_TEXT, add_special=False)
    tokens = tokenizer.encode(SYSTEM_TEXT) + filler * (length // len(filler) + 1)
    return tokens[:length]


def message(tokenizer: Tokenizer, label: str) -> list[int]:
    """MESSAGE_TOKENS tokens that begin with `label`: messages of distinct labels differ."""
    filler = tokenizer.encode(" Please answer from the text above, in one sentence.", add_special=False)
    tokens = tokenizer.encode(f" Question {label}:", add_special=False) + filler * MESSAGE_TOKENS
    return tokens[:MESSAGE_TOKENS]


# ---- one new session of each variant --------------------------------------------------------------------


def wait_stored(clients: Sequence[Client], tokens: Sequence[int]) -> float:
    """Seconds until every daemon's prefix store holds every whole block of `tokens` (a prefill's state is
    saved after its reply, and a lookup waits for the saves pending: this sees it at once unless the store
    refused it)."""
    digests = chain_digests(tokens, clients[0].hello.prefix_block)
    started = time.perf_counter()
    while not all(client.lookup_prefix("", digests) == len(digests) for client in clients):
        if time.perf_counter() - started > STORE_HANG_GUARD_S:
            raise RuntimeError(f"hang guard: {len(digests)} blocks not stored on every daemon after {STORE_HANG_GUARD_S:.0f} s")
        time.sleep(0.002)
    return time.perf_counter() - started


def _routed_once(clients: Sequence[Client], session_id: str, prompt: list[int], *, prefix_cache: bool) -> dict:
    """A new session's first append through a Router (timed); with the prefix cache, the wait for the store of
    its blocks (timed apart), then its release."""
    router = Router(clients, prefix_cache=prefix_cache)
    session = router.session(session_id)
    started = time.perf_counter()
    logits = session.append(prompt)
    ttft_s = time.perf_counter() - started
    capture_s = wait_stored(clients, prompt) if prefix_cache else 0.0
    counts = router.counts
    first_append = session.partition[0]
    session.release()
    return {"s": ttft_s, "capture_s": capture_s, "logits": logits[-1].copy(), "reused_tokens": counts.prefix_hit_tokens,
            "hits": counts.prefix_hits, "fallbacks": counts.prefix_fallbacks, "first_append_rows": first_append}


def _llama_once(context: PlainContext, state: ctypes.Array, at: int, rest: list[int]) -> dict:
    """The kept context: the saved state of `at` positions restored into it (timed), then the message (timed)."""
    started = time.perf_counter()
    context.restore_state(state, at)
    restored = time.perf_counter()
    logits = context.append(at, np.asarray(rest, dtype=np.int32))[-1].copy()
    done = time.perf_counter()
    return {"s": done - started, "restore_s": restored - started, "rows_s": done - restored, "logits": logits}


def _llama_fresh_once(model: ShardModel, state: ctypes.Array, at: int, rest: list[int]) -> dict:
    """A context created for the request (timed), then as _llama_once; freed after, untimed."""
    started = time.perf_counter()
    context = PlainContext(model, PREFIX_N_CTX, n_threads=SINGLE_THREADS)
    try:
        created = time.perf_counter()
        got = _llama_once(context, state, at, rest)
    finally:
        context.close()
    return {**got, "s": got["s"] + created - started, "create_s": created - started}


def _walk_timed(clients: Sequence[Client], session_id: str, at: int, rest: list[int], *, digests: list[bytes],
                ahead: RestoringAhead | None = None) -> dict:
    """One append of `rest` at position `at` through every daemon, carrying `digests` (of the blocks it
    completes, as the router's append does: a daemon that lacks them saves its state for the store after its
    reply): each one's seconds and `restored` flag, the logits; with `ahead` (restores of the later daemons
    running), its outcomes waited for before the second daemon's part, as the router waits (the wait counted
    apart, not in that part)."""
    rows: list[int] | np.ndarray = rest
    seconds, restored, outcomes, wait_s = [], [], [], 0.0
    for stage, client in enumerate(clients):
        if stage == 1 and ahead is not None:
            started = time.perf_counter()
            outcomes = ahead.wait()
            wait_s = time.perf_counter() - started
        inputs = {"tokens": list(rows)} if stage == 0 else {"hidden": rows}
        started = time.perf_counter()
        result = client.append(session_id, EPOCH, at, **inputs, block_digests=digests)
        seconds.append(time.perf_counter() - started)
        restored.append(result.restored)
        rows = result.rows
    assert isinstance(rows, np.ndarray)
    return {"s": seconds, "restored": restored, "ahead": outcomes, "ahead_wait_s": wait_s, "logits": rows[-1].copy()}


def _components_once(clients: Sequence[Client], session_id: str, system: list[int], rest: list[int]) -> dict:
    """What the cached variant's first append does, one step at a time as the router takes them
    (kvpool.router.prefix): the lookup and the admission from the prefix, each on every daemon at once; the
    first append, which restores the session on the first daemon while the later ones restore it in a thread
    (kvpool.router.prefix.RestoringAhead) and computes the message (each daemon saves the prompt's new block
    for the store after its reply, beside the next one's part); and, truncated back (once those saves are in),
    the same append again hot (the rows alone)."""
    route = Route(clients)
    block, chain = clients[0].hello.prefix_block, PrefixChain("")
    digests = chain.digests(system, block)
    completed = chain.completed(system, rest, block)  # the blocks the message completes, as the router's append names them
    started = time.perf_counter()
    held = held_everywhere(route, "", digests)
    lookup_s = time.perf_counter() - started
    admitted = admit_everywhere(route, session_id, EPOCH, "", digests[:held], 0)
    admit_s = time.perf_counter() - started - lookup_s
    ahead = RestoringAhead.start(route, session_id, EPOCH) if admitted else None
    try:
        first = _walk_timed(clients, session_id, len(system), rest, digests=completed, ahead=ahead)
    finally:
        if ahead is not None:
            ahead.wait()  # no restore of this session left on its way, whatever the walk met
    for client in clients:
        client.truncate(session_id, EPOCH, len(system))
    hot = _walk_timed(clients, session_id, len(system), rest, digests=completed)  # the store holds them now: no save
    for client in clients:
        client.release(session_id, EPOCH)
    restored = first["restored"][:1] + [getattr(outcome, "detail", "") == "restored" for outcome in first["ahead"]]
    return {"held_blocks": held, "admitted": admitted, "restored": restored, "lookup_s": lookup_s, "admit_s": admit_s,
            "ahead_wait_s": first["ahead_wait_s"], "first_append_s": first["s"], "hot_append_s": hot["s"]}


# ---- time to first token ----------------------------------------------------------------------------------


def _measure_ttft(clients: list[Client], whole: ShardModel, tokenizer: Tokenizer, system: list[int], rounds: int,
                  say: Callable[[str], None]) -> dict:
    kept = PlainContext(whole, PREFIX_N_CTX, n_threads=SINGLE_THREADS)
    try:
        prefill_s = time_call(lambda: kept.append(0, np.asarray(system, dtype=np.int32)))
        state = kept.save_state()
        seed = system + message(tokenizer, "seed")  # the earlier session: it stores the system prompt (and its message)
        seed_s = _routed_once(clients, "bench-prefix-seed", seed, prefix_cache=True)["s"]

        def run(name: str, label: str, session_id: str) -> dict:
            rest = message(tokenizer, label)
            if name in (CACHED, UNCACHED):
                return _routed_once(clients, session_id, system + rest, prefix_cache=name == CACHED)
            if name == LLAMA:
                return _llama_once(kept, state, len(system), rest)
            if name == LLAMA_FRESH:
                return _llama_fresh_once(whole, state, len(system), rest)
            return _components_once(clients, session_id, system, message(tokenizer, f"{label}c"))

        for name in (CACHED, LLAMA, LLAMA_FRESH, COMPONENTS):  # warm-up (the seed was the uncached one): first contexts, saves, restores
            run(name, "warm-up", f"bench-prefix-warm-up-{name}")
        runs: dict[str, list] = {name: [] for name in VARIANTS}
        for round_index, order in run_interleaved(rounds, VARIANTS):
            for name in order:
                runs[name].append(run(name, str(round_index), f"bench-prefix-{round_index}-{name.replace(' ', '-')}"))
            say(f"prefix: round {round_index + 1}/{rounds}: cached {runs[CACHED][-1]['s'] * 1e3:.0f} ms, uncached {runs[UNCACHED][-1]['s']:.2f} s, "
                f"llama.cpp {runs[LLAMA][-1]['s'] * 1e3:.0f} ms")
    finally:
        kept.close()
    logits = {name: [one.pop("logits") for one in runs[name]] for name in (CACHED, UNCACHED, LLAMA, LLAMA_FRESH)}
    reference = logits[LLAMA]
    return {
        "runs": runs, "reference_prefill_s": prefill_s, "seed_prefill_s": seed_s, "prefix_state_bytes": len(state),
        "first_tokens": {name: [int(np.argmax(row)) for row in rows] for name, rows in logits.items()},
        "logits_max_abs_diff_vs_llama_cpp": {name: [float(np.max(np.abs(row - ref))) for row, ref in zip(rows, reference)]
                                             for name, rows in logits.items() if name != LLAMA},
    }


# ---- memory of SESSIONS sessions sharing the prefix ----------------------------------------------------------


def _reading(client: Client, daemon: Daemon) -> dict:
    stats = client.stats()
    prefixes = stats.prefixes
    return {"reserved_bytes": stats.budget.reserved_bytes, "workers_uss_bytes": stats.budget.measured_uss_bytes,
            "tree_uss_bytes": daemon_uss(daemon), "spill_bytes": stats.budget.spill_bytes,
            "prefix_bytes": prefixes.bytes if prefixes else 0, "prefix_entries": prefixes.entries if prefixes else 0,
            "sessions": [{"id": row.session_id, "tier": row.tier, "length": row.length, "charged_bytes": row.charged_bytes} for row in stats.sessions],
            "integrity": stats.integrity}


def _measure_memory(mode: str, shards: Sequence[ShardInfo], tokenizer: Tokenizer, system: list[int], socket_dir: pathlib.Path,
                    say: Callable[[str], None]) -> dict:
    plan = {f"prefix-{mode}{index}": (shard.path, MEMORY_OPTIONS[mode]) for index, shard in enumerate(shards)}
    with contextlib.ExitStack() as stack:
        say(f"prefix: memory, --mode {mode}: starting {len(plan)} daemons")
        started = time.perf_counter()
        daemons = list(start_daemons(plan, socket_dir, stack).values())
        start_s = time.perf_counter() - started
        clients = [stack.enter_context(Client(daemon.socket, name="kvpool-bench")) for daemon in daemons]
        at_start = [_reading(client, daemon) for client, daemon in zip(clients, daemons)]
        _routed_once(clients, f"bench-prefix-{mode}-seed", system + message(tokenizer, f"{mode} seed"), prefix_cache=True)
        after_seed = [_reading(client, daemon) for client, daemon in zip(clients, daemons)]
        router = Router(clients)
        sessions, ttft_s = [], []
        for index in range(SESSIONS):
            session = router.session(f"bench-prefix-{mode}-{index}")
            prompt = system + message(tokenizer, f"{mode} {index}")
            ttft_s.append(time_call(lambda session=session, prompt=prompt: session.append(prompt)))
            wait_stored(clients, prompt)
            sessions.append(session)
        held = [_reading(client, daemon) for client, daemon in zip(clients, daemons)]
        counts = router.counts
        for session in sessions:
            session.release()
        left = [len(client.stats().sessions) for client in clients]
    return {"mode": mode, "daemon_options": MEMORY_OPTIONS[mode], "daemon_start_s": start_s, "sessions": SESSIONS,
            "at_start": at_start, "after_seed": after_seed, "held": held, "ttft_s": ttft_s,
            "reused_tokens": counts.prefix_hit_tokens, "hits": counts.prefix_hits, "sessions_left": left}


# ---- the section ------------------------------------------------------------------------------------------


def measure_prefix(shards: Sequence[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions,
                   say: Callable[[str], None]) -> dict:
    system = system_prompt(tokenizer, options.prefix_system_tokens)
    if len(system) != options.prefix_system_tokens:
        raise ValueError(f"prefix: the system prompt gives {len(system)} tokens, {options.prefix_system_tokens} needed")
    labels = ["seed", "warm-up", "warm-upc", *(f"{r}{c}" for r in range(options.prefix_rounds) for c in ("", "c"))]
    labels += [f"{mode} {index}" for mode in MEMORY_OPTIONS for index in ("seed", *range(SESSIONS))]
    if len({tuple(message(tokenizer, label)) for label in labels}) != len(labels):
        raise ValueError("prefix: the messages of two sessions have the same tokens")
    kv_per_position = []
    for shard in shards:
        with ShardModel(shard.path, n_threads=SINGLE_THREADS) as model:
            kv_per_position.append(model.kv_bytes_per_position())
    plan = {f"prefix{index}": (shard.path, DAEMON_OPTIONS) for index, shard in enumerate(shards)}
    with contextlib.ExitStack() as stack:
        say(f"prefix: starting {len(plan)} daemons (--n-ctx {PREFIX_N_CTX})")
        started = time.perf_counter()
        daemons = start_daemons(plan, socket_dir, stack)
        start_s = time.perf_counter() - started
        clients = [stack.enter_context(Client(daemon.socket, name="kvpool-bench")) for daemon in daemons.values()]
        block = clients[0].hello.prefix_block
        whole = stack.enter_context(ShardModel(options.model, n_threads=SINGLE_THREADS))
        ttft = _measure_ttft(clients, whole, tokenizer, system, options.prefix_rounds, say)
        stats = [client.stats() for client in clients]
    memory = {mode: _measure_memory(mode, shards, tokenizer, system, socket_dir, say) for mode in MEMORY_OPTIONS}
    return {"system_tokens": len(system), "message_tokens": MESSAGE_TOKENS, "block": block, "n_ctx": PREFIX_N_CTX, "rounds": options.prefix_rounds,
            "threads": SINGLE_THREADS, "daemon_options": DAEMON_OPTIONS, "daemon_start_s": start_s,
            "shard_sha256": {shard.path.name: file_sha256(shard.path) for shard in shards},
            "kv_bytes_per_position": kv_per_position, **ttft, "memory": memory,
            "integrity": [one.integrity for one in stats], "sessions_left": sum(len(one.sessions) for one in stats),
            "prefix_stores": [{"bytes": one.prefixes.bytes, "entries": one.prefixes.entries, "hits": one.prefixes.hits, "evictions": one.prefixes.evictions}
                              if one.prefixes else None for one in stats]}

"""Sections 1, 2 and 4, one session each: the middle shard (decode and prefill) through a daemon and
in-process, and greedy decode through the whole route."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.bench.options import EPOCH, ROUTE_N_CTX, bench_say
from kvpool.bench.reference import PlainContext
from kvpool.bench.relay import Relay
from kvpool.bench.rig import Rig, Variant, payload_seconds, round_trips, run_interleaved, time_call
from kvpool.client.client import Client
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling

MID_SESSION = "bench-mid"
RELAY = "relay"  # the variant of kvpool.bench.relay: the same shard(s) in processes with no kvpool code
IDLE_MID_S = 0.002  # a middle-shard decode step: the mid daemon's threads sleep this long per append
IDLE_CHAIN_S = 0.006  # about the other two hops of a chain step: each chain daemon sleeps this long between appends


# ---- section 1 and 4: the middle shard, one session -------------------------------------------------


def mid_shard_variants(rig: Rig, client: Client) -> tuple[dict[str, Variant], Callable[[], None]]:
    session = MID_SESSION
    admitted = [False]

    def daemon_reset() -> None:
        if admitted[0]:
            client.truncate(session, EPOCH, 0)

    def daemon_append(start: int, rows: np.ndarray) -> object:
        admitted[0] = True
        return client.append(session, EPOCH, start, hidden=rows).rows

    runtime = rig.mid_model.new_context(ROUTE_N_CTX)
    plain = PlainContext(rig.mid_model, ROUTE_N_CTX, n_threads=rig.threads)
    relay = Relay([rig.middle.path], threads=rig.threads, n_ctx=ROUTE_N_CTX)  # last: nothing after it can fail and leave its processes

    def close() -> None:
        relay.close()
        runtime.close()
        plain.close()
        client.release(session, EPOCH)

    variants = {
        "daemon": Variant(daemon_reset, daemon_append),
        "runtime": Variant(lambda: runtime.truncate(0), lambda start, rows: runtime.append(start, hidden=rows)),
        "llama.cpp": Variant(plain.reset, plain.append),
        RELAY: Variant(relay.reset, relay.append),
    }
    return variants, close


def measure_mid_shard(rig: Rig) -> dict:
    """Section 1 (decode after `history` rows, every step timed) and section 4 (prefill), interleaved;
    after each round, the mid daemon's request round trips (IPC without compute). Within a round the
    variants take turns every `chunk_steps` timed steps, each its own context: a slow spell of the machine
    lasts seconds and hits every variant alike. Each turn's first step, right after another variant ran,
    is timed and kept apart (`cold_decode_s`)."""
    options = rig.options
    hidden, history, steps, chunk = rig.mid_hidden, options.history, options.decode_steps, options.chunk_steps
    client = rig.client("mid")
    variants, close = mid_shard_variants(rig, client)
    decode: dict[str, list[float]] = {name: [] for name in variants}
    cold: dict[str, list[float]] = {name: [] for name in variants}
    prefill: dict[str, list[float]] = {name: [] for name in variants}
    trips: dict[str, list[float]] = {"supervisor": [], "worker": [], "worker_after_idle": []}
    try:
        for variant in variants.values():  # warm-up: first runs allocate buffers
            variant.reset()
            variant.append(0, hidden[: options.prefill_rows])
            variant.reset()
            variant.append(0, hidden[:history])
            for step in range(4):
                variant.append(history + step, hidden[history + step : history + step + 1])
        for round_index, order in run_interleaved(options.rounds, list(variants)):
            position = dict.fromkeys(order, history)
            for name in order:
                variants[name].reset()
                variants[name].append(0, hidden[:history])
            for timed in range(0, steps, chunk):
                for name in order:
                    variant = variants[name]
                    for turn_step in range(1 + min(chunk, steps - timed)):
                        at = position[name]
                        row = hidden[at : at + 1]
                        (cold if turn_step == 0 else decode)[name].append(time_call(lambda: variant.append(at, row)))
                        position[name] = at + 1
            for name in order:
                variant = variants[name]
                variant.reset()
                prefill[name].append(time_call(lambda: variant.append(0, hidden[: options.prefill_rows])))
            for kind, values in round_trips(client, MID_SESSION, options.prefill_rows, max(8, steps // 2), IDLE_MID_S).items():
                trips[kind].extend(values)
            bench_say(f"middle shard: round {round_index + 1}/{options.rounds}")
    finally:
        close()
    payload = payload_seconds(hidden[:1], rig.middle.shape.n_embd, count=200)
    return {"decode_s": decode, "cold_decode_s": cold, "chunk_steps": chunk, "prefill_s": prefill, "round_trip_s": trips, "payload_s": payload,
            "threads": rig.threads, "keep_warm_s": rig.options.keep_warm_s}


# ---- section 2: one session through the whole route -------------------------------------------------


def route_variants(rig: Rig, chain_clients: list[Client], whole_client: Client) -> tuple[dict[str, Variant], Callable[[], None]]:
    whole = PlainContext(rig.whole_model, ROUTE_N_CTX, n_threads=rig.threads)
    local = rig.chain.new_session(ROUTE_N_CTX)
    chain_session, whole_session = "bench-route-chain", "bench-route-whole"
    routed = Router(chain_clients).session(chain_session, epoch=EPOCH)
    sampled = Router(chain_clients).session("bench-route-sampled", epoch=EPOCH)
    relay = Relay([shard.path for shard in rig.shards], threads=rig.threads, n_ctx=ROUTE_N_CTX)  # last: nothing after it can fail and leave its processes
    n_vocab = rig.shards[-1].shape.n_vocab

    def one_hot(token: int) -> np.ndarray:
        """A token picked on the last shard (its id comes back, not logits), as a row whose argmax it is, so the
        same greedy loop drives every variant."""
        row = np.zeros((1, n_vocab), np.float32)
        row[0, token] = 1.0
        return row

    def sampled_append(start: int, tokens: Sequence[int]) -> np.ndarray:
        if start != sampled.length:
            raise ValueError(f"start {start} != the session's length {sampled.length}")
        return one_hot(sampled.sample(tokens, Sampling()).token)

    used: set[str] = set()

    def daemon_variant(session: str, reset_clients: list[Client], append) -> Variant:
        def reset() -> None:
            if session in used:
                for client in reset_clients:
                    client.truncate(session, EPOCH, 0)

        def append_tokens(start: int, tokens: Sequence[int]) -> np.ndarray:
            used.add(session)
            return append(start, tokens)

        return Variant(reset, append_tokens)

    variants = {
        "llama.cpp whole": Variant(whole.reset, lambda start, tokens: whole.append(start, np.asarray(tokens, dtype=np.int32))),
        "in-process chain": Variant(lambda: local.truncate(0), lambda start, tokens: local.append(start, tokens)),
        "daemon chain": Variant(lambda: routed.truncate(0), routed.append_at),
        "daemon chain, sampled on the last": Variant(lambda: sampled.truncate(0), sampled_append),
        "daemon whole": daemon_variant(whole_session, [whole_client], lambda start, tokens: whole_client.append(whole_session, EPOCH, start, tokens=list(tokens), n_ctx=ROUTE_N_CTX).rows),
        RELAY: Variant(relay.reset, lambda start, tokens: one_hot(int(relay.append(start, np.asarray(tokens, dtype=np.int32))[0]))),
    }

    def close() -> None:
        relay.close()
        whole.close()
        local.close()
        routed.release()
        sampled.release()
        whole_client.release(whole_session, EPOCH)

    return variants, close


class _Greedy:
    """One variant's greedy decode, a step at a time: reset and the prompt appended on creation; each step()
    picks the next token from the last logits (argmax) and appends it, returning its seconds."""

    def __init__(self, variant: Variant, prompt: Sequence[int]) -> None:
        self.variant = variant
        variant.reset()
        self.logits = variant.append(0, prompt)
        self.position = len(prompt)
        self.generated: list[int] = []

    def step(self) -> float:
        started = time.perf_counter()
        token = int(np.argmax(self.logits[-1]))
        self.generated.append(token)
        self.logits = self.variant.append(self.position, [token])
        self.position += 1
        return time.perf_counter() - started


def _greedy_run(variant: Variant, prompt: Sequence[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`, untimed (the warm-up, whose tokens every variant must agree on)."""
    run = _Greedy(variant, prompt)
    for _ in range(steps):
        run.step()
    return run.generated


def measure_route(rig: Rig, chain_clients: list[Client], whole_client: Client) -> dict:
    """Section 2: greedy decode of one session by each variant (kvpool.bench.one_session.route_variants), in
    rounds; within a round the variants take turns every `chunk_steps` timed steps, as in section 1, each on its
    own session: the host's speed moves by tens of percent from one second to the next on some machines (a
    context's own step, turn by turn: evidence/daemon-overhead/README.md, "Stop 50"), so a variant that ran its
    steps all at once would carry its own seconds' speed into the ratio. Each turn's first step, right after another
    variant ran, is timed and kept apart (`cold_decode_s`). After each round, each chain daemon's round trips."""
    options = rig.options
    variants, close = route_variants(rig, chain_clients, whole_client)
    prompt = rig.prompts[0]
    steps, chunk = options.decode_steps, options.chunk_steps
    if len(prompt) + steps + options.cold_steps > ROUTE_N_CTX:
        raise ValueError(f"the route's prompt ({len(prompt)} tokens) and {steps} + {options.cold_steps} steps do not fit n_ctx {ROUTE_N_CTX}")
    times: dict[str, list[float]] = {name: [] for name in variants}
    cold: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {}
    trips: list[dict[str, list[float]]] = [{"supervisor": [], "worker": [], "worker_after_idle": []} for _ in chain_clients]
    try:
        for name, variant in variants.items():
            tokens[name] = _greedy_run(variant, prompt, min(steps, 16))  # warm-up; the tokens are compared
        for round_index, order in run_interleaved(options.rounds, list(variants)):
            runs = {name: _Greedy(variants[name], prompt) for name in order}
            for timed in range(0, steps, chunk):
                for name in order:
                    for turn_step in range(1 + min(chunk, steps - timed)):
                        (cold if turn_step == 0 else times)[name].append(runs[name].step())
            length = runs["daemon chain"].position
            for index, client in enumerate(chain_clients):
                for kind, values in round_trips(client, "bench-route-chain", length, max(8, steps // 2), IDLE_CHAIN_S).items():
                    trips[index][kind].extend(values)
            bench_say(f"whole route: round {round_index + 1}/{options.rounds}")
    finally:
        close()
    shard_widths = [shard.shape.output_width for shard in rig.shards]
    inputs = [np.asarray(prompt[:1], dtype=np.int32)] + [rig.mid_hidden[:1]] * (len(rig.shards) - 1)
    payload = [payload_seconds(rows, width, count=200) for rows, width in zip(inputs, shard_widths)]
    reference = tokens["llama.cpp whole"]
    return {
        "decode_s": times,
        "cold_decode_s": cold,
        "chunk_steps": chunk,
        "round_trip_s": trips,
        "payload_s_per_hop": payload,
        "tokens_identical": {name: generated == reference for name, generated in tokens.items()},
        "threads": rig.threads,
        "keep_warm_s": rig.options.keep_warm_s,
    }

"""Section 3: four sessions at once, through kvpool (one whole-model daemon, a chain of three) against
llama.cpp batched decoding and a no-IPC ceiling of kvpool's schedule."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pathlib
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import psutil

from kvpool.bench.options import EPOCH, PARALLEL_THREADS, ROUTE_N_CTX, SESSIONS, bench_say
from kvpool.bench.reference import BatchedContext, PlainContext
from kvpool.bench.rig import Rig, run_interleaved
from kvpool.client.client import Client
from kvpool.daemon.mode_probe import probe_modes
from kvpool.launcher import Daemon
from kvpool.wire.sampling import Sampling
from workers.runtime.model import ShardModel

BATCHED_WHOLE = "kvpool whole model, 1 daemon, --mode batched"
BATCHED_CHAIN = "kvpool 3-shard chain, --mode batched, capped at 2 in flight"
CEILING = f"no IPC: {PARALLEL_THREADS} processes x 1 thread, {SESSIONS // PARALLEL_THREADS} sessions each in turn"


# ---- section 3: four sessions at once ---------------------------------------------------------------


def _parallel_kvpool(
    appenders: list[Callable[[int, Sequence[int]], int]], prompts: list[list[int]], steps: int,
    on_start: Callable[[], None] = lambda: None, on_end: Callable[[], None] = lambda: None,
) -> float:
    """Each session in its own thread (as four routers' requests arrive): prefill, wait for all, then
    `steps` greedy decode steps (each appender returns the next token). Aggregate decode tokens/s from the common start to the last finish;
    on_start and on_end run around the decode phase."""
    barrier = threading.Barrier(len(appenders) + 1)
    finished = [0.0] * len(appenders)
    errors: list[BaseException] = []

    def session(index: int) -> None:
        try:
            append, prompt = appenders[index], prompts[index]
            token = append(0, prompt)
            barrier.wait()
            position = len(prompt)
            for _ in range(steps):
                token = append(position, [token])
                position += 1
            finished[index] = time.perf_counter()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=session, args=(index,), name=f"bench-session-{index}") for index in range(len(appenders))]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    started = time.perf_counter()
    on_start()
    for thread in threads:
        thread.join()
    on_end()
    if errors:
        raise errors[0]
    return len(appenders) * steps / (max(finished) - started)


def _parallel_batched(model: ShardModel, unified: bool, prompts: list[list[int]], alone: list[float], steps: int) -> float:
    """A context of its own per run (created and freed untimed), so no other llama context is alive in
    this process while it decodes. After the batched steps, the first sequence decodes `steps` more tokens
    alone in the same context: its tokens/s go into `alone` (the reference's self-check,
    kvpool.bench.checks.broken_reference)."""
    batched = BatchedContext(model, len(prompts), ROUTE_N_CTX, n_threads=PARALLEL_THREADS, unified=unified)
    try:
        tokens = batched.prefill(prompts)
        positions = [len(prompt) for prompt in prompts]
        started = time.perf_counter()
        for _ in range(steps):
            tokens = batched.step(tokens, positions)
            positions = [position + 1 for position in positions]
        rate = len(prompts) * steps / (time.perf_counter() - started)
        token, position = tokens[0], positions[0]
        started = time.perf_counter()
        for _ in range(steps):
            token = batched.step_alone(0, token, position)
            position += 1
        alone.append(steps / (time.perf_counter() - started))
        return rate
    finally:
        batched.close()


def _ceiling_process(connection, model_path: str, n_ctx: int, barrier) -> None:
    """A process with 1 llama thread that decodes its share of the sessions in turn, with no IPC on
    the way: what a process-per-session design could reach at best with the same thread budget."""
    model = ShardModel(model_path, n_threads=1)
    contexts: list[PlainContext] = []
    try:
        while (message := connection.recv()) is not None:
            prompts, steps = message
            while len(contexts) < len(prompts):
                contexts.append(PlainContext(model, n_ctx, n_threads=1))
            tokens, positions = [], []
            for context, prompt in zip(contexts, prompts):
                context.reset()
                tokens.append(int(np.argmax(context.append(0, np.asarray(prompt, dtype=np.int32))[-1])))
                positions.append(len(prompt))
            barrier.wait()
            started = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            for _ in range(steps):
                for index, context in enumerate(contexts):
                    logits = context.append(positions[index], np.asarray(tokens[index : index + 1], dtype=np.int32))
                    tokens[index] = int(np.argmax(logits[-1]))
                    positions[index] += 1
            connection.send((started, time.perf_counter()))
    finally:
        for context in contexts:
            context.close()
        model.close()


class CeilingProcesses:
    """PARALLEL_THREADS processes x 1 thread sharing the sessions: kvpool's compute schedule, minus kvpool."""

    def __init__(self, model_path: pathlib.Path, count: int, n_ctx: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.barrier = context.Barrier(count)
        self.connections = []
        self.processes = []
        for index in range(count):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_ceiling_process, args=(child_end, str(model_path), n_ctx, self.barrier),
                                      name=f"kvpool-bench-ceiling-{index}", daemon=True)
            process.start()
            child_end.close()
            self.connections.append(parent_end)
            self.processes.append(process)

    def run(self, prompts: list[list[int]], steps: int) -> float:
        count = len(self.connections)
        for index, connection in enumerate(self.connections):
            connection.send((prompts[index::count], steps))
        spans = [connection.recv() for connection in self.connections]
        return len(prompts) * steps / (max(end for _start, end in spans) - min(start for start, _end in spans))

    def close(self) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


def _daemon_cpu_s(daemon: Daemon) -> dict[str, float]:
    """CPU seconds used so far by a daemon's workers, by its supervisor, and by this process (the router)."""

    def used(pid: int) -> float:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return times.user + times.system

    return {
        "workers": sum(used(pid) for pid in daemon.worker_pids()),
        "supervisor": used(daemon.process.pid),
        "router": used(os.getpid()),
    }


GREEDY = Sampling()  # kvpool's sessions pick the greedy token on the last shard (a few bytes back, not the logits)


def _whole_appender(client: Client, session: str) -> Callable[[int, Sequence[int]], int]:
    def append(start: int, tokens: Sequence[int]) -> int:
        return client.append(session, EPOCH, start, tokens=list(tokens), n_ctx=ROUTE_N_CTX, sample=GREEDY).token

    return append


def _chain_appender(clients: list[Client], session: str, limiter: threading.Semaphore | None) -> Callable[[int, Sequence[int]], int]:
    """A router's step through the chain; with a limiter, each hop holds one of its slots while in flight."""
    gate = limiter if limiter is not None else contextlib.nullcontext()

    def append(start: int, tokens: Sequence[int]) -> int:
        first, *middle, last = clients
        with gate:
            rows = first.append(session, EPOCH, start, tokens=list(tokens)).rows
        for client in middle:
            with gate:
                rows = client.append(session, EPOCH, start, hidden=rows).rows
        with gate:
            return last.append(session, EPOCH, start, hidden=rows, sample=GREEDY).token

    return append


def measure_parallel(rig: Rig) -> dict:
    options = rig.options
    prompts = [list(prompt) for prompt in rig.prompts[:SESSIONS]]
    whole_clients = [rig.client("whole") for _ in range(SESSIONS)]
    chain_clients = [[rig.client(f"chain{index}") for index in range(len(rig.shards))] for _ in range(SESSIONS)]
    whole_batched_clients = [rig.client("wholeb") for _ in range(SESSIONS)]
    chain_batched_clients = [[rig.client(f"chainb{index}") for index in range(len(rig.shards))] for _ in range(SESSIONS)]
    batched = {"llama.cpp batched, unified KV": True, "llama.cpp batched, KV stream per sequence": False}
    ceiling = CeilingProcesses(rig.options.model, PARALLEL_THREADS, ROUTE_N_CTX)
    cap = threading.Semaphore(PARALLEL_THREADS)
    round_counter = [0]
    whole = rig.daemons["whole"]
    whole_cpu: list[dict[str, float]] = []  # CPU seconds per decoded token, by process role, per round
    alone: dict[str, list[float]] = {name: [] for name in batched}  # one sequence alone in each batched context, tok/s per round

    def whole_appenders(tag: str) -> list:
        return [_whole_appender(whole_clients[index], f"bench-par-{tag}-{index}") for index in range(SESSIONS)]

    def chain_appenders(tag: str, limiter: threading.Semaphore | None, clients=chain_clients) -> list:
        return [_chain_appender(clients[index], f"bench-par-{tag}-{index}", limiter) for index in range(SESSIONS)]

    def whole_batched_appenders(tag: str) -> list:
        return [_whole_appender(whole_batched_clients[index], f"bench-par-{tag}-{index}") for index in range(SESSIONS)]

    def release(tag: str, clients_per_session: list[list[Client]]) -> None:
        for index, clients in enumerate(clients_per_session):
            for client in clients:
                client.release(f"bench-par-{tag}-{index}", EPOCH)

    def kvpool_variant(make: Callable[[str], list], clients_per_session: list[list[Client]], steps: int, cpu: list | None = None) -> float:
        round_counter[0] += 1
        tag = str(round_counter[0])
        samples: list[dict[str, float]] = []
        try:
            rate = _parallel_kvpool(make(tag), prompts, steps, lambda: samples.append(_daemon_cpu_s(whole)), lambda: samples.append(_daemon_cpu_s(whole)))
        finally:
            release(tag, clients_per_session)
        if cpu is not None:
            tokens = SESSIONS * steps
            cpu.append({part: (samples[1][part] - samples[0][part]) / tokens for part in samples[0]})
        return rate

    runners: dict[str, Callable[[int], float]] = {
        **{name: functools.partial(_parallel_batched, rig.whole_model, unified, prompts, alone[name]) for name, unified in batched.items()},
        CEILING: lambda steps: ceiling.run(prompts, steps),
        "kvpool whole model, 1 daemon": lambda steps: kvpool_variant(whole_appenders, [[c] for c in whole_clients], steps, whole_cpu),
        "kvpool 3-shard chain, capped at 2 in flight": lambda steps: kvpool_variant(lambda tag: chain_appenders(tag, cap), chain_clients, steps),
        "kvpool 3-shard chain, uncapped": lambda steps: kvpool_variant(lambda tag: chain_appenders(tag, None), chain_clients, steps),
        BATCHED_WHOLE: lambda steps: kvpool_variant(whole_batched_appenders, [[c] for c in whole_batched_clients], steps),
        BATCHED_CHAIN: lambda steps: kvpool_variant(lambda tag: chain_appenders(tag, cap, chain_batched_clients), chain_batched_clients, steps),
    }
    rates: dict[str, list[float]] = {name: [] for name in runners}
    try:
        for name, runner in runners.items():  # warm-up (and the whole daemon's calibration of n_ctx 1024)
            runner(4)
        for rates_alone in alone.values():
            rates_alone.clear()  # the warm-up's
        for round_index, order in run_interleaved(options.parallel_rounds, list(runners)):
            for name in order:
                rates[name].append(runners[name](options.parallel_steps))
            bench_say(f"four sessions: round {round_index + 1}/{options.parallel_rounds}")
    finally:
        ceiling.close()
    bench_say("four sessions: what --mode auto picks for the whole model (kvpool.daemon.mode_probe)")
    choice = probe_modes(str(rig.options.model), sessions=SESSIONS, threads=PARALLEL_THREADS, n_ctx=64)
    auto = {"mode": choice.mode, "probe_process_tok_s": choice.process_tok_s, "probe_batched_tok_s": choice.batched_tok_s}
    return {"tokens_per_s": rates, "alone_tokens_per_s": alone, "whole_daemon_cpu_s_per_token": whole_cpu[1:], "auto": auto}  # [0] is the warm-up

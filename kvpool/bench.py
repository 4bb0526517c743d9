"""`kvpool bench`: kvpool side by side with llama.cpp on the bundled model, as ratios measured in one run.

Sections (issue 5), each comparing variants interleaved round by round in one run (the machine is shared
and noisy: compare the ratios, not the absolute times; every figure is a median):

  1 daemon overhead, one session   middle-shard decode through a daemon / the worker runtime in-process /
                                   llama.cpp in-process without capture
  2 whole route, one session       greedy decode through a chain of 3 shard daemons / the whole model in one
                                   llama.cpp context, and where the difference goes, from measured components
  3 four sessions at once          aggregate decode tok/s through kvpool / llama.cpp serving the four as
                                   sequences of one context with one batched llama_decode per step
  4 prefill                        512 rows into the middle shard through a daemon / in-process
  5 admission and reclaim          admit on a warm worker / a bare llama context; release; LRU eviction
  6 memory                         bytes charged / theoretical KV / measured USS growth; daemon USS

Threads: every single-session figure uses 1 llama thread per computing context (kvpool's default
--threads-per-worker). Four sessions: llama.cpp batched uses 2 threads; the whole-model daemon runs
`--threads 2 --threads-per-worker 1` (at most 2 workers compute at once); the chain's three daemons run
`--threads 1` each, which alone would allow 3 single threads at once across daemons, so the benchmark's
router caps the chain at 2 appends in flight (at most 2 llama threads); an uncapped chain row is shown too.
Flash attention is off everywhere. Greedy decoding continues past end-of-generation tokens (timing only).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import multiprocessing
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import llama_cpp
import numpy as np
import psutil

from kvpool.bundled import bundled_model_path
from kvpool.chain import LocalChain
from kvpool.client import Client
from kvpool.config import work_dir
from kvpool.daemon_route import DaemonRoute
from kvpool.launcher import Daemon
from kvpool.protocol import Append, AppendReply, decode_reply, decode_request, encode
from kvpool.shardcache import cached_shards
from kvpool.shardfile import ShardInfo, even_splits, file_sha256, read_shard_info
from kvpool.tokenizer import Tokenizer
from workers.runtime import ShardModel

DAEMON_OVERHEAD_TARGET = 0.95  # daemon tok/s >= 0.95 x in-process tok/s
PARALLEL_TARGET = 1.2  # kvpool aggregate tok/s >= 1.2 x llama.cpp batched
SESSIONS = 4
PARALLEL_THREADS = 2  # llama threads computing at once in section 3 (the machine's cores)
SINGLE_THREADS = 1  # llama threads of a single-session context
CEILING = f"no IPC: {PARALLEL_THREADS} processes x 1 thread, {SESSIONS // PARALLEL_THREADS} sessions each in turn"
ROUTE_N_CTX = 1024  # context of the decode and prefill sessions
MID_SESSION = "bench-mid"
IDLE_MID_S = 0.002  # a middle-shard decode step: the mid daemon's threads sleep this long per append
IDLE_CHAIN_S = 0.006  # about the other two hops of a chain step: each chain daemon sleeps this long between appends
EPOCH = 1
PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright while it moves.",
    "List three reasons why people keep houseplants, with one sentence each.",
    "Describe the water cycle to a ten-year-old.",
)
FILLER_TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. " * 80


def _say(message: str) -> None:
    print(f"kvpool bench: {time.strftime('%H:%M:%S', time.gmtime())} {message}", file=sys.stderr, flush=True)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _mib(value: float) -> float:
    return value / 1024**2


@dataclasses.dataclass(frozen=True, slots=True)
class BenchOptions:
    """What one run measures; `quick_run()` is the short run the test uses."""

    out_dir: pathlib.Path
    model: pathlib.Path
    quick: bool = False
    rounds: int = 7  # interleaved rounds of the single-session sections
    decode_steps: int = 96  # timed decode steps per round and variant
    history: int = 64  # rows in the middle shard's context before its decode steps
    prefill_rows: int = 512
    parallel_rounds: int = 7
    parallel_steps: int = 64  # decode steps per session per round in section 3
    repeats: int = 11  # admissions, releases and evictions measured per size
    admit_n_ctx: tuple[int, ...] = (512, 2048, 8192)
    chart: bool = True

    def __post_init__(self) -> None:
        if min(self.rounds, self.decode_steps, self.history, self.prefill_rows, self.parallel_rounds, self.parallel_steps, self.repeats) < 1:
            raise ValueError("rounds, steps, history, prefill rows and repeats must be at least 1")
        if self.prefill_rows > ROUTE_N_CTX or self.history + self.decode_steps + 8 > ROUTE_N_CTX:
            raise ValueError(f"prefill rows and history + decode steps must fit in n_ctx {ROUTE_N_CTX}")

    @classmethod
    def quick_run(cls, out_dir: pathlib.Path, model: pathlib.Path) -> BenchOptions:
        return cls(out_dir=out_dir, model=model, quick=True, rounds=2, decode_steps=8, history=16,
                   parallel_rounds=1, parallel_steps=8, repeats=2)

    @property
    def max_n_ctx(self) -> int:
        return max(self.admit_n_ctx)


# ---- llama.cpp in-process, no kvpool code: the references -------------------------------------------


class PlainContext:
    """llama.cpp on one model file with no eval callback: one sequence, last-row output, like any app."""

    def __init__(self, model: ShardModel, n_ctx: int, *, n_threads: int, n_batch: int = 512) -> None:
        self.layout = model.layout
        self.n_batch = min(n_batch, n_ctx)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self.ctx:
            raise MemoryError(f"llama.cpp could not create a context of n_ctx {n_ctx}")
        self.takes_tokens = self.layout.is_first
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0 if self.takes_tokens else self.layout.n_embd, 1)
        if self.takes_tokens:
            self.rows = np.ctypeslib.as_array(self.batch.token, shape=(self.n_batch,))
        else:
            self.rows = np.ctypeslib.as_array(self.batch.embd, shape=(self.n_batch, self.layout.n_embd))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(self.n_batch,))
        self.outputs = np.ctypeslib.as_array(self.batch.logits, shape=(self.n_batch,))
        for row in range(self.n_batch):
            self.batch.n_seq_id[row] = 1
            self.batch.seq_id[row][0] = 0
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def reset(self) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, 0, 0, -1)

    def append(self, start_pos: int, rows: np.ndarray) -> np.ndarray | None:
        """Last row's logits (a view into llama.cpp's buffer) on a last shard, else None."""
        for chunk in range(0, len(rows), self.n_batch):
            part = rows[chunk : chunk + self.n_batch]
            count = len(part)
            self.rows[:count] = part
            self.pos[:count] = np.arange(start_pos + chunk, start_pos + chunk + count, dtype=np.int32)
            self.outputs[:count] = 0
            self.outputs[count - 1] = 1
            self.batch.n_tokens = count
            status = llama_cpp.llama_decode(self.ctx, self.batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
        if not self.layout.is_last:
            return None
        logits = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(1, self.layout.n_vocab))

    def close(self) -> None:
        if self.ctx is not None:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


class BatchedContext:
    """llama.cpp's own way to serve several sessions: one context, one sequence each, and one
    llama_decode per step with one row per sequence (what llama.cpp's server does with -np 4)."""

    def __init__(self, model: ShardModel, n_seq: int, n_ctx_per_seq: int, *, n_threads: int, unified: bool) -> None:
        self.n_vocab = model.layout.n_vocab
        self.n_seq = n_seq
        self.n_batch = 512
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx_per_seq * n_seq
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = n_seq
        params.kv_unified = unified
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self.ctx:
            raise MemoryError("llama.cpp could not create the batched context")
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(self.n_batch,))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(self.n_batch,))
        self.outputs = np.ctypeslib.as_array(self.batch.logits, shape=(self.n_batch,))
        self.seq = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(self.n_batch,))
        self.seq[:] = 1
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def _decode(self, count: int) -> None:
        self.batch.n_tokens = count
        status = llama_cpp.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _greedy(self, row: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))))

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """Every prompt in one batch (as the server does); the first greedy token of each."""
        last_rows = []
        row = 0
        for seq, prompt in enumerate(prompts):
            llama_cpp.llama_memory_seq_rm(self.memory, seq, 0, -1)
            for position, token in enumerate(prompt):
                self.tokens[row], self.pos[row], self.outputs[row] = token, position, 0
                self.batch.seq_id[row][0] = seq
                row += 1
            self.outputs[row - 1] = 1
            last_rows.append(row - 1)
        self._decode(row)
        return [self._greedy(index) for index in last_rows]

    def step(self, tokens: Sequence[int], positions: Sequence[int]) -> list[int]:
        """One decode step of every sequence: one llama_decode of n_seq rows; the next greedy tokens."""
        for seq, (token, position) in enumerate(zip(tokens, positions)):
            self.tokens[seq], self.pos[seq], self.outputs[seq] = token, position, 1
            self.batch.seq_id[seq][0] = seq
        self._decode(len(tokens))
        return [self._greedy(seq) for seq in range(len(tokens))]

    def close(self) -> None:
        if self.ctx is not None:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


# ---- what the bench runs on -------------------------------------------------------------------------


class Rig:
    """The daemons, in-process models, clients and inputs of one run; close() tears all down."""

    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        self._stack = contextlib.ExitStack()
        self.socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
        self._stack.callback(shutil.rmtree, self.socket_dir, ignore_errors=True)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        options = self.options
        source = options.model
        total = read_shard_info(source).total_layers
        self.shards: list[ShardInfo] = cached_shards(source, even_splits(total, 3), progress=_say)
        self.middle = self.shards[1]
        common = ["--ttl", "600", "--threads-per-worker", "1"]
        route = [*common, "--n-ctx", str(ROUTE_N_CTX)]
        plan = {
            "mid": (self.middle.path, [*route, "--threads", str(SINGLE_THREADS), "--max-sessions", "1"]),
            **{f"chain{index}": (shard.path, [*route, "--threads", "1", "--max-sessions", str(SESSIONS)]) for index, shard in enumerate(self.shards)},
            "whole": (source, [*common, "--threads", str(PARALLEL_THREADS), "--max-sessions", str(SESSIONS),
                              "--n-ctx", str(options.max_n_ctx), "--budget", "2GiB"]),
        }
        self.daemon_options = {name: options_ for name, (_path, options_) in plan.items()}
        _say(f"starting {len(plan)} daemons ({sum(int(o[o.index('--max-sessions') + 1]) for _p, o in plan.values())} workers), sockets in {self.socket_dir}")
        started = time.perf_counter()
        self.daemons: dict[str, Daemon] = {}
        for name, (path, daemon_options) in plan.items():
            daemon = Daemon(path, self.socket_dir / f"{name}.sock", daemon_options)
            self.daemons[name] = daemon
            self._stack.callback(daemon.stop)
        for daemon in self.daemons.values():
            daemon.wait_ready()
        self.daemon_start_s = time.perf_counter() - started
        _say(f"daemons ready in {self.daemon_start_s:.1f} s")
        self.daemon_uss_at_start = daemon_uss(self.daemons["whole"])

        self.tokenizer = self._stack.enter_context(Tokenizer(source))
        self.prompts = [self.tokenizer.encode(self.tokenizer.chat_prompt(text)) for text in PROMPTS]
        self.whole_model = self._stack.enter_context(ShardModel(source, n_threads=SINGLE_THREADS))
        self.mid_model = self._stack.enter_context(ShardModel(self.middle.path, n_threads=SINGLE_THREADS))
        self.chain = self._stack.enter_context(LocalChain([shard.path for shard in self.shards], n_threads=SINGLE_THREADS))
        needed = max(options.prefill_rows, options.history + options.decode_steps + 8)
        filler = self.tokenizer.encode(FILLER_TEXT)[:needed]
        if len(filler) < needed:
            raise ValueError(f"the filler text gives {len(filler)} tokens, {needed} needed")
        with self.chain.models[0].new_context(ROUTE_N_CTX) as first:
            self.mid_hidden = first.append(0, tokens=np.asarray(filler, dtype=np.int32)).copy()

    def client(self, name: str) -> Client:
        client = Client(self.daemons[name].socket, name="kvpool-bench")
        self._stack.callback(client.close)
        return client

    def close(self) -> None:
        self._stack.close()


def daemon_uss(daemon: Daemon) -> int:
    """USS of the daemon's whole process tree: supervisor, workers, resource tracker."""
    try:
        root = psutil.Process(daemon.process.pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += process.memory_full_info().uss
    return total


def _timed(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def _interleaved(rounds: int, names: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    """Round r runs the variants forwards on even r, backwards on odd r (drift hits all alike)."""
    for round_index in range(rounds):
        yield round_index, list(names) if round_index % 2 == 0 else list(reversed(names))


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    """One way of running a session: reset() empties its context; append(start, rows) appends rows (token
    ids or hidden states) and returns what that way returns (hidden states, or last-row logits)."""

    reset: Callable[[], None]
    append: Callable[[int, object], object]


def round_trips(client: Client, session: str, length: int, count: int, idle_s: float) -> dict[str, list[float]]:
    """IPC without compute or payload: a request the supervisor answers alone (release of an unknown
    session), one that goes to the session's worker and back (truncate to the current length), and the
    same after idle_s of sleep, as a daemon's threads are found by an append: asleep (during the compute,
    or between a chain's hops), and an idle core's wake-up is not free on a VM."""
    times: dict[str, list[float]] = {"supervisor": [], "worker": [], "worker_after_idle": []}
    for _ in range(count):
        times["supervisor"].append(_timed(lambda: client.release("bench-no-such-session", EPOCH)))
        times["worker"].append(_timed(lambda: client.truncate(session, EPOCH, length)))
        time.sleep(idle_s)
        times["worker_after_idle"].append(_timed(lambda: client.truncate(session, EPOCH, length)))
    return times


def payload_seconds(rows: np.ndarray, out_floats: int, *, count: int) -> float:
    """The data path of one append without sockets, threads or compute, replayed in-process: the
    client's encode, the supervisor's decode and copy into shared memory, its copy out of shared
    memory and encode of the reply, the client's receive copy and decode. Median seconds."""
    input_region = np.empty(rows.size, dtype=rows.dtype)
    output_region = np.random.default_rng(0).random(out_floats, dtype=np.float32).tobytes()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        if rows.dtype == np.int32:
            request = Append(session_id="s", epoch=1, start_pos=0, tokens=[int(token) for token in rows])
        else:
            request = Append(session_id="s", epoch=1, start_pos=0, hidden=np.ascontiguousarray(rows, dtype="<f4").tobytes())
        decoded = decode_request(encode(request)[4:])
        if decoded.tokens is not None:
            received = np.asarray(decoded.tokens, dtype=np.int64).astype(np.int32)
        else:
            received = np.frombuffer(decoded.hidden, dtype="<f4")
        input_region[:] = received.reshape(-1)
        data = bytes(memoryview(output_region))
        frame = encode(AppendReply(session_id="s", epoch=1, length=1, rows=1, width=out_floats, data=data))
        reply = decode_reply(bytes(bytearray(frame[4:])))
        np.frombuffer(reply.data, dtype="<f4")
        times.append(time.perf_counter() - started)
    return _median(times)


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
    plain = PlainContext(rig.mid_model, ROUTE_N_CTX, n_threads=SINGLE_THREADS)

    def close() -> None:
        runtime.close()
        plain.close()
        client.release(session, EPOCH)

    variants = {
        "daemon": Variant(daemon_reset, daemon_append),
        "runtime": Variant(lambda: runtime.truncate(0), lambda start, rows: runtime.append(start, hidden=rows)),
        "llama.cpp": Variant(plain.reset, plain.append),
    }
    return variants, close


def measure_mid_shard(rig: Rig) -> dict:
    """Section 1 (decode after `history` rows, every step timed) and section 4 (prefill), interleaved;
    after each round, the mid daemon's request round trips (IPC without compute)."""
    options = rig.options
    hidden, history, steps = rig.mid_hidden, options.history, options.decode_steps
    client = rig.client("mid")
    variants, close = mid_shard_variants(rig, client)
    decode: dict[str, list[float]] = {name: [] for name in variants}
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
        for round_index, order in _interleaved(options.rounds, list(variants)):
            for name in order:
                variant = variants[name]
                variant.reset()
                variant.append(0, hidden[:history])
                for step in range(steps):
                    row = hidden[history + step : history + step + 1]
                    decode[name].append(_timed(lambda: variant.append(history + step, row)))
                variant.reset()
                prefill[name].append(_timed(lambda: variant.append(0, hidden[: options.prefill_rows])))
            for kind, values in round_trips(client, MID_SESSION, options.prefill_rows, max(8, steps // 2), IDLE_MID_S).items():
                trips[kind].extend(values)
            _say(f"middle shard: round {round_index + 1}/{options.rounds}")
    finally:
        close()
    payload = payload_seconds(hidden[:1], rig.middle.n_embd, count=200)
    return {"decode_s": decode, "prefill_s": prefill, "round_trip_s": trips, "payload_s": payload}


# ---- section 2: one session through the whole route -------------------------------------------------


def route_variants(rig: Rig, chain_clients: list[Client], whole_client: Client) -> tuple[dict[str, Variant], Callable[[], None]]:
    whole = PlainContext(rig.whole_model, ROUTE_N_CTX, n_threads=SINGLE_THREADS)
    local = rig.chain.new_session(ROUTE_N_CTX)
    route = DaemonRoute(chain_clients)
    chain_session, whole_session = "bench-route-chain", "bench-route-whole"
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
        "daemon chain": daemon_variant(chain_session, chain_clients, lambda start, tokens: route.append(chain_session, EPOCH, start, tokens)),
        "daemon whole": daemon_variant(whole_session, [whole_client], lambda start, tokens: whole_client.append(whole_session, EPOCH, start, tokens=list(tokens), n_ctx=ROUTE_N_CTX).rows),
    }

    def close() -> None:
        whole.close()
        local.close()
        route.release(chain_session, EPOCH)
        whole_client.release(whole_session, EPOCH)

    return variants, close


def _greedy_run(variant: Variant, prompt: Sequence[int], steps: int, times: list[float] | None) -> list[int]:
    variant.reset()
    logits = variant.append(0, prompt)
    generated = []
    position = len(prompt)
    for _ in range(steps):
        started = time.perf_counter()
        token = int(np.argmax(logits[-1]))
        generated.append(token)
        logits = variant.append(position, [token])
        if times is not None:
            times.append(time.perf_counter() - started)
        position += 1
    return generated


def measure_route(rig: Rig, chain_clients: list[Client], whole_client: Client) -> dict:
    options = rig.options
    variants, close = route_variants(rig, chain_clients, whole_client)
    prompt = rig.prompts[0]
    steps = options.decode_steps
    times = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {}
    trips: list[dict[str, list[float]]] = [{"supervisor": [], "worker": [], "worker_after_idle": []} for _ in chain_clients]
    try:
        for name, variant in variants.items():
            tokens[name] = _greedy_run(variant, prompt, min(steps, 16), None)  # warm-up; the tokens are compared
        for round_index, order in _interleaved(options.rounds, list(variants)):
            for name in order:
                _greedy_run(variants[name], prompt, steps, times[name])
            length = len(prompt) + steps
            for index, client in enumerate(chain_clients):
                for kind, values in round_trips(client, "bench-route-chain", length, max(8, steps // 2), IDLE_CHAIN_S).items():
                    trips[index][kind].extend(values)
            _say(f"whole route: round {round_index + 1}/{options.rounds}")
    finally:
        close()
    shard_widths = [rig.shards[0].n_embd] * (len(rig.shards) - 1) + [rig.shards[-1].n_vocab]
    inputs = [np.asarray(prompt[:1], dtype=np.int32)] + [rig.mid_hidden[:1]] * (len(rig.shards) - 1)
    payload = [payload_seconds(rows, width, count=200) for rows, width in zip(inputs, shard_widths)]
    reference = tokens["llama.cpp whole"]
    return {
        "decode_s": times,
        "round_trip_s": trips,
        "payload_s_per_hop": payload,
        "tokens_identical": {name: generated == reference for name, generated in tokens.items()},
    }


# ---- section 3: four sessions at once ---------------------------------------------------------------


def _parallel_kvpool(
    appenders: list[Callable[[int, Sequence[int]], np.ndarray]], prompts: list[list[int]], steps: int,
    on_start: Callable[[], None] = lambda: None, on_end: Callable[[], None] = lambda: None,
) -> float:
    """Each session in its own thread (as four routers' requests arrive): prefill, wait for all, then
    `steps` greedy decode steps. Aggregate decode tokens/s from the common start to the last finish;
    on_start and on_end run around the decode phase."""
    barrier = threading.Barrier(len(appenders) + 1)
    finished = [0.0] * len(appenders)
    errors: list[BaseException] = []

    def session(index: int) -> None:
        try:
            append, prompt = appenders[index], prompts[index]
            logits = append(0, prompt)
            barrier.wait()
            position = len(prompt)
            for _ in range(steps):
                logits = append(position, [int(np.argmax(logits[-1]))])
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


def _parallel_batched(model: ShardModel, unified: bool, prompts: list[list[int]], steps: int) -> float:
    """A context of its own per run (created and freed untimed), so no other llama context is alive in
    this process while it decodes."""
    batched = BatchedContext(model, len(prompts), ROUTE_N_CTX, n_threads=PARALLEL_THREADS, unified=unified)
    try:
        tokens = batched.prefill(prompts)
        positions = [len(prompt) for prompt in prompts]
        started = time.perf_counter()
        for _ in range(steps):
            tokens = batched.step(tokens, positions)
            positions = [position + 1 for position in positions]
        return len(prompts) * steps / (time.perf_counter() - started)
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


def _whole_appender(client: Client, session: str) -> Callable[[int, Sequence[int]], np.ndarray]:
    def append(start: int, tokens: Sequence[int]) -> np.ndarray:
        return client.append(session, EPOCH, start, tokens=list(tokens), n_ctx=ROUTE_N_CTX).rows

    return append


def _chain_appender(clients: list[Client], session: str, limiter: threading.Semaphore | None) -> Callable[[int, Sequence[int]], np.ndarray]:
    """A router's step through the chain; with a limiter, each hop holds one of its slots while in flight."""
    gate = limiter if limiter is not None else contextlib.nullcontext()

    def append(start: int, tokens: Sequence[int]) -> np.ndarray:
        first, *rest = clients
        with gate:
            rows = first.append(session, EPOCH, start, tokens=list(tokens)).rows
        for client in rest:
            with gate:
                rows = client.append(session, EPOCH, start, hidden=rows).rows
        return rows

    return append


def measure_parallel(rig: Rig) -> dict:
    options = rig.options
    prompts = [list(prompt) for prompt in rig.prompts[:SESSIONS]]
    whole_clients = [rig.client("whole") for _ in range(SESSIONS)]
    chain_clients = [[rig.client(f"chain{index}") for index in range(len(rig.shards))] for _ in range(SESSIONS)]
    batched = {"llama.cpp batched, unified KV": True, "llama.cpp batched, KV stream per sequence": False}
    ceiling = CeilingProcesses(rig.options.model, PARALLEL_THREADS, ROUTE_N_CTX)
    cap = threading.Semaphore(PARALLEL_THREADS)
    round_counter = [0]
    whole = rig.daemons["whole"]
    whole_cpu: list[dict[str, float]] = []  # CPU seconds per decoded token, by process role, per round

    def whole_appenders(tag: str) -> list:
        return [_whole_appender(whole_clients[index], f"bench-par-{tag}-{index}") for index in range(SESSIONS)]

    def chain_appenders(tag: str, limiter: threading.Semaphore | None) -> list:
        return [_chain_appender(chain_clients[index], f"bench-par-{tag}-{index}", limiter) for index in range(SESSIONS)]

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
        **{name: functools.partial(_parallel_batched, rig.whole_model, unified, prompts) for name, unified in batched.items()},
        CEILING: lambda steps: ceiling.run(prompts, steps),
        "kvpool whole model, 1 daemon": lambda steps: kvpool_variant(whole_appenders, [[c] for c in whole_clients], steps, whole_cpu),
        "kvpool 3-shard chain, capped at 2 in flight": lambda steps: kvpool_variant(lambda tag: chain_appenders(tag, cap), chain_clients, steps),
        "kvpool 3-shard chain, uncapped": lambda steps: kvpool_variant(lambda tag: chain_appenders(tag, None), chain_clients, steps),
    }
    rates: dict[str, list[float]] = {name: [] for name in runners}
    try:
        for name, runner in runners.items():  # warm-up (and the whole daemon's calibration of n_ctx 1024)
            runner(4)
        for round_index, order in _interleaved(options.parallel_rounds, list(runners)):
            for name in order:
                rates[name].append(runners[name](options.parallel_steps))
            _say(f"four sessions: round {round_index + 1}/{options.parallel_rounds}")
    finally:
        ceiling.close()
    return {"tokens_per_s": rates, "whole_daemon_cpu_s_per_token": whole_cpu[1:]}  # [0] is the warm-up


# ---- sections 5 and 6: admission, reclaim, memory (whole-model daemon) --------------------------------


def measure_admission(rig: Rig) -> dict:
    client = rig.client("whole")
    token = rig.prompts[0][:1]
    results: dict[str, dict] = {"first_admit_s": {}, "admit_s": {}, "release_s": {}, "reclaim_visible_s": {},
                                "uss_kept_bytes": {}, "bare_create_s": {}, "bare_free_s": {}, "inprocess_admit_s": {}}
    counter = iter(range(10**9))

    def admit(n_ctx: int) -> tuple[str, float]:
        session = f"bench-admit-{next(counter)}"
        elapsed = _timed(lambda: client.append(session, EPOCH, 0, tokens=token, n_ctx=n_ctx))
        return session, elapsed

    calibrated_at_start = rig.options.max_n_ctx
    reference_pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        _measure_admissions(rig, client, admit, token, reference_pool, results, calibrated_at_start)
    finally:
        reference_pool.shutdown()
    return _measure_eviction(rig, client, admit, token, results)


def _admission_reference(model_path: str, n_ctx: int, token: list[int], repeats: int) -> tuple[list[float], list[float], list[float]]:
    """In a fresh process: bare llama context create and free, and the worker runtime's create + 1-token append."""
    create, free, inprocess = [], [], []
    with ShardModel(model_path, n_threads=SINGLE_THREADS) as model:
        for _ in range(repeats):
            started = time.perf_counter()
            plain = PlainContext(model, n_ctx, n_threads=SINGLE_THREADS)
            create.append(time.perf_counter() - started)
            free.append(_timed(plain.close))
            started = time.perf_counter()
            context = model.new_context(n_ctx)
            context.append(0, tokens=np.asarray(token, dtype=np.int32))
            inprocess.append(time.perf_counter() - started)
            context.close()
    return create, free, inprocess


def _measure_admissions(rig: Rig, client: Client, admit, token: list[int], reference_pool, results: dict, calibrated_at_start: int) -> None:
    options = rig.options
    for n_ctx in options.admit_n_ctx:
        session, first = admit(n_ctx)
        client.release(session, EPOCH)
        results["first_admit_s"][n_ctx] = None if n_ctx == calibrated_at_start else first
        admits, releases, visible, kept = [], [], [], []
        for _ in range(options.repeats):
            before_stats = client.stats()
            before = before_stats.budget.reserved_bytes
            session, elapsed = admit(n_ctx)
            admits.append(elapsed)
            started = time.perf_counter()
            client.release(session, EPOCH)
            releases.append(time.perf_counter() - started)
            while True:
                stats = client.stats()
                if stats.budget.reserved_bytes == before:
                    break
            visible.append(time.perf_counter() - started)
            kept.append(stats.budget.measured_uss_bytes - before_stats.budget.measured_uss_bytes)
        results["admit_s"][n_ctx] = admits
        results["release_s"][n_ctx] = releases
        results["reclaim_visible_s"][n_ctx] = visible
        results["uss_kept_bytes"][n_ctx] = kept
        # in-process references, in a process of their own (as clean as a worker: the bench process's own
        # allocator holds memory freed by earlier sections, which would make its context creation look cheap)
        create, free, inprocess = reference_pool.submit(_admission_reference, str(options.model), n_ctx, token, options.repeats).result()
        results["bare_create_s"][n_ctx] = create
        results["bare_free_s"][n_ctx] = free
        results["inprocess_admit_s"][n_ctx] = inprocess
        _say(f"admission: n_ctx {n_ctx} done")


def _measure_eviction(rig: Rig, client: Client, admit, token: list[int], results: dict) -> dict:
    options = rig.options
    # a 1-token decode through the daemon, to take the compute out of the admitting append
    session, _ = admit(2048)
    decode = [_timed(lambda position=position: client.append(session, EPOCH, position, tokens=token)) for position in range(1, 1 + max(16, options.repeats * 4))]
    client.release(session, EPOCH)
    results["decode_s"] = decode

    # LRU eviction: every worker bound to an idle session, then each new admission evicts the oldest
    live = [admit(2048)[0] for _ in range(SESSIONS)]
    evictions_before = client.stats().counters.get("evictions", 0)
    evict = []
    for _ in range(options.repeats):
        session, elapsed = admit(2048)
        evict.append(elapsed)
        live.append(session)
    evictions = client.stats().counters.get("evictions", 0) - evictions_before
    for session in live:
        client.release(session, EPOCH)
    results["evict_admit_s"] = evict
    results["evictions_counted"] = evictions
    _say("admission: LRU eviction done")
    return results


def measure_memory(rig: Rig) -> dict:
    client = rig.client("whole")
    daemon = rig.daemons["whole"]
    prompt = rig.prompts[1]
    per_position = rig.whole_model.kv_bytes_per_position()
    per_session = {}
    for n_ctx in rig.options.admit_n_ctx:
        workers_before = client.stats().workers
        before = {worker.pid: worker.uss_bytes for worker in workers_before}
        baseline = {worker.pid: worker.baseline_uss_bytes for worker in workers_before}
        session = f"bench-memory-{n_ctx}"
        client.append(session, EPOCH, 0, tokens=prompt, n_ctx=n_ctx)
        stats = client.stats()
        row = next(row for row in stats.sessions if row.session_id == session)
        after = next(worker.uss_bytes for worker in stats.workers if worker.pid == row.worker_pid)
        per_session[n_ctx] = {
            "charged_bytes": row.charged_bytes,
            "theoretical_kv_bytes": n_ctx * per_position,
            "uss_growth_bytes": after - before[row.worker_pid],
            # memory the worker already held above its start-up USS (freed by earlier contexts, kept by the allocator)
            "held_before_bytes": before[row.worker_pid] - baseline[row.worker_pid],
        }
        client.release(session, EPOCH)
    daemon_totals = {0: daemon_uss(daemon)}
    sessions = []
    for count in range(1, SESSIONS + 1):
        session = f"bench-memory-live-{count}"
        client.append(session, EPOCH, 0, tokens=prompt, n_ctx=2048)
        sessions.append(session)
        if count in (1, SESSIONS):
            daemon_totals[count] = daemon_uss(daemon)
    for session in sessions:
        client.release(session, EPOCH)
    _say("memory done")
    return {
        "kv_bytes_per_position": per_position,
        "per_session": per_session,
        "daemon_uss_bytes": daemon_totals,
        "daemon_uss_at_start_bytes": rig.daemon_uss_at_start,
        "daemon_sessions_n_ctx": 2048,
    }


# ---- the report: one table, JSON, chart -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    section: str
    what: str
    kvpool: str
    reference: str
    ratio: str
    target: str = ""


def _verdict(value: float, target: float) -> str:
    return f">= {target:.2f}: {'met' if value >= target else 'MISSED'}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def _rate(seconds: float) -> str:
    return f"{1 / seconds:.0f} tok/s ({_ms(seconds)})"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_").replace("__", "_")


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "n/a"


def summarize(results: dict) -> tuple[dict, list[Row]]:
    """Medians and ratios from the raw measurements, and the table rows."""
    summary: dict[str, float | int | bool] = {}
    rows: list[Row] = []

    mid = results["mid_shard"]
    decode = {name: _median(values) for name, values in mid["decode_s"].items()}
    prefill = {name: _median(values) for name, values in mid["prefill_s"].items()}
    mid_trip = _median(mid["round_trip_s"]["worker_after_idle"])
    mid_trip_hot = _median(mid["round_trip_s"]["worker"])
    mid_supervisor = _median(mid["round_trip_s"]["supervisor"])
    overhead = decode["daemon"] - decode["runtime"]
    mid_rest = overhead - mid_trip - mid["payload_s"]
    daemon_vs_runtime = decode["runtime"] / decode["daemon"]
    summary.update({
        "s1_daemon_decode_s": decode["daemon"], "s1_runtime_decode_s": decode["runtime"], "s1_llamacpp_decode_s": decode["llama.cpp"],
        "s1_daemon_vs_runtime": daemon_vs_runtime, "s1_daemon_vs_llamacpp": decode["llama.cpp"] / decode["daemon"],
        "s1_runtime_vs_llamacpp": decode["llama.cpp"] / decode["runtime"],
        "s1_overhead_s": overhead, "s1_round_trip_after_idle_s": mid_trip, "s1_round_trip_hot_s": mid_trip_hot,
        "s1_round_trip_supervisor_only_s": mid_supervisor, "s1_payload_s": mid["payload_s"], "s1_rest_s": mid_rest,
    })
    rows += [
        Row("1", "middle shard decode: daemon vs the same shard in-process (worker runtime)", _rate(decode["daemon"]), _rate(decode["runtime"]),
            f"{daemon_vs_runtime:.3f}x tok/s", _verdict(daemon_vs_runtime, DAEMON_OVERHEAD_TARGET)),
        Row("1", "middle shard decode: daemon vs llama.cpp in-process, no capture", _rate(decode["daemon"]), _rate(decode["llama.cpp"]),
            f"{decode['llama.cpp'] / decode['daemon']:.3f}x tok/s"),
        Row("1", "middle shard decode: worker runtime (capture, graph stopped) vs llama.cpp, no capture", _rate(decode["runtime"]), _rate(decode["llama.cpp"]),
            f"{decode['llama.cpp'] / decode['runtime']:.3f}x tok/s"),
        Row("1", "daemon overhead per token (daemon minus worker runtime)", _ms(overhead), "", "100%"),
        Row("1", f"  round trip client-supervisor-worker-back, no compute, after {IDLE_MID_S * 1e3:.0f} ms idle "
                 f"(hot: {_ms(mid_trip_hot)}; supervisor only: {_ms(mid_supervisor)})", _ms(mid_trip), "", _share(mid_trip, overhead)),
        Row("1", "  payload: encode, decode, shared-memory copies of one row each way (replayed in-process, hot caches)",
            _ms(mid["payload_s"]), "", _share(mid["payload_s"], overhead)),
        Row("1", "  rest: append bookkeeping in supervisor and worker, compute-slot semaphore, scheduling", _ms(mid_rest), "", _share(mid_rest, overhead)),
    ]

    route = results["route"]
    greedy = {name: _median(values) for name, values in route["decode_s"].items()}
    whole, local, chain = greedy["llama.cpp whole"], greedy["in-process chain"], greedy["daemon chain"]
    difference = chain - whole
    split = local - whole
    trips = sum(_median(hop["worker_after_idle"]) for hop in route["round_trip_s"])
    trips_hot = sum(_median(hop["worker"]) for hop in route["round_trip_s"])
    payload = sum(route["payload_s_per_hop"])
    rest = chain - local - trips - payload
    summary.update({
        "s2_chain_decode_s": chain, "s2_whole_decode_s": whole, "s2_local_chain_decode_s": local, "s2_daemon_whole_decode_s": greedy["daemon whole"],
        "s2_chain_vs_whole": whole / chain, "s2_split_s": split, "s2_round_trips_s": trips, "s2_round_trips_hot_s": trips_hot, "s2_payload_s": payload, "s2_rest_s": rest,
        "s2_tokens_identical": all(route["tokens_identical"].values()),
    })
    rows += [
        Row("2", "greedy decode, one session: 3 shard daemons vs the whole model in one llama.cpp context", _rate(chain), _rate(whole), f"{whole / chain:.3f}x tok/s"),
        Row("2", "greedy decode: whole model through 1 daemon vs in one llama.cpp context", _rate(greedy["daemon whole"]), _rate(whole),
            f"{whole / greedy['daemon whole']:.3f}x tok/s"),
        Row("2", "greedy decode: 3 shards in-process (LocalChain) vs the whole model in one context", _rate(local), _rate(whole), f"{whole / local:.3f}x tok/s"),
        Row("2", "where the difference goes (3 daemons minus whole model), per token", _ms(difference), "", "100%"),
        Row("2", "  split into 3 contexts in-process: 3 graphs, capture, Python (LocalChain minus whole)", _ms(split), "", _share(split, difference)),
        Row("2", f"  IPC round trips: 3 x client-supervisor-worker-back after {IDLE_CHAIN_S * 1e3:.0f} ms idle (hot: {_ms(trips_hot)})",
            _ms(trips), "", _share(trips, difference)),
        Row("2", "  payload: 2 hidden-state hops + 192 KiB of logits, encode/decode/copies (replayed in-process, hot caches)", _ms(payload), "", _share(payload, difference)),
        Row("2", "  rest: append bookkeeping, thread hand-offs, scheduling (daemons minus LocalChain minus the two above)", _ms(rest), "", _share(rest, difference)),
        Row("2", "greedy tokens identical in all four paths", "yes" if summary["s2_tokens_identical"] else "NO", "", ""),
    ]

    parallel = {name: _median(values) for name, values in results["parallel"]["tokens_per_s"].items()}
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
    cpu = {part: _median([sample[part] for sample in cpu_rounds]) for part in ("workers", "supervisor", "router")}
    whole_rate = parallel["kvpool whole model, 1 daemon"]
    budget = PARALLEL_THREADS / whole_rate
    idle = budget - sum(cpu.values())
    summary.update({f"s3_whole_cpu_{part}_s_per_token": value for part, value in cpu.items()})
    rows.append(Row("3", f"four sessions, kvpool whole model: where the {PARALLEL_THREADS} cores' time per token goes "
                         f"({PARALLEL_THREADS} cores / its rate = {_ms(budget)}) vs the no-IPC ceiling's {_ms(PARALLEL_THREADS / ceiling)}",
                    f"workers {_ms(cpu['workers'])}; supervisor {_ms(cpu['supervisor'])}; router (this process) {_ms(cpu['router'])}; idle {_ms(idle)}",
                    f"{_ms(PARALLEL_THREADS / ceiling)} compute", f"{_share(cpu['workers'], budget)} / {_share(cpu['supervisor'], budget)} / "
                    f"{_share(cpu['router'], budget)} / {_share(idle, budget)}"))
    notes = {
        "kvpool whole model, 1 daemon": f"--threads {PARALLEL_THREADS} --threads-per-worker 1: at most {PARALLEL_THREADS} workers compute",
        "kvpool 3-shard chain, capped at 2 in flight": f"3 daemons x --threads 1; router allows {PARALLEL_THREADS} appends in flight: at most {PARALLEL_THREADS} threads",
        "kvpool 3-shard chain, uncapped": "3 daemons x --threads 1: up to 3 single threads on 2 cores",
    }
    for name, note in notes.items():
        ratio = parallel[name] / best
        summary[f"s3_{_slug(name)}_vs_batched"] = ratio
        rows.append(Row("3", f"four sessions: {name} ({note}) vs the best llama.cpp batched", f"{parallel[name]:.0f} tok/s{spread[name]}", f"{best:.0f} tok/s",
                        f"{ratio:.3f}x tok/s", _verdict(ratio, PARALLEL_TARGET) if "uncapped" not in name else "(3 threads: not counted)"))

    rows_n = results["options"]["prefill_rows"]
    summary.update({"s4_daemon_prefill_s": prefill["daemon"], "s4_runtime_prefill_s": prefill["runtime"], "s4_llamacpp_prefill_s": prefill["llama.cpp"]})
    rows += [
        Row("4", f"prefill {rows_n} rows, middle shard: daemon vs in-process (worker runtime)", _ms(prefill["daemon"]), _ms(prefill["runtime"]),
            f"{prefill['runtime'] / prefill['daemon']:.3f}x tok/s"),
        Row("4", f"prefill {rows_n} rows: daemon vs llama.cpp in-process, no capture, last row out", _ms(prefill["daemon"]), _ms(prefill["llama.cpp"]),
            f"{prefill['llama.cpp'] / prefill['daemon']:.3f}x tok/s"),
    ]

    admission = results["admission"]
    decode_step = _median(admission["decode_s"])
    summary["s5_daemon_decode_step_s"] = decode_step
    for n_ctx in results["options"]["admit_n_ctx"]:
        key = str(n_ctx)
        admit = _median(admission["admit_s"][key])
        inprocess = _median(admission["inprocess_admit_s"][key])
        bare = _median(admission["bare_create_s"][key])
        net = admit - decode_step
        summary.update({f"s5_admit_{n_ctx}_s": admit, f"s5_inprocess_admit_{n_ctx}_s": inprocess, f"s5_bare_create_{n_ctx}_s": bare})
        rows.append(Row("5", f"admit n_ctx {n_ctx} on a warm worker: admitting 1-token append vs in-process create + 1-token append",
                        _ms(admit), _ms(inprocess), f"{admit / inprocess:.2f}x time"))
        rows.append(Row("5", f"  admission alone (minus a {_ms(decode_step)} decode through the daemon) vs a bare llama context create",
                        _ms(net), _ms(bare), f"{net / bare:.2f}x time"))
    first = admission["first_admit_s"]
    firsts = []
    for n_ctx in results["options"]["admit_n_ctx"]:
        value = first[str(n_ctx)]
        steady = _median(admission["admit_s"][str(n_ctx)])
        if value is None:
            firsts.append(f"{n_ctx}: at daemon start")
        else:
            summary[f"s5_first_admit_{n_ctx}_s"] = value
            firsts.append(f"{n_ctx}: {_ms(value)} (+{_ms(value - steady)})")
    rows.append(Row("5", "first admission of an n_ctx (calibration: a context + 512-row prefill measured, then freed)", "; ".join(firsts),
                    "steady state above", ""))
    release = _median([v for values in admission["release_s"].values() for v in values])
    visible = _median([v for values in admission["reclaim_visible_s"].values() for v in values])
    free = _median([v for values in admission["bare_free_s"].values() for v in values])
    kept = {n_ctx: _median(values) for n_ctx, values in admission["uss_kept_bytes"].items()}
    summary.update({"s5_release_s": release, "s5_reclaim_visible_s": visible, "s5_bare_free_s": free})
    summary.update({f"s5_uss_kept_{n_ctx}_bytes": value for n_ctx, value in kept.items()})
    rows.append(Row("5", "release -> bytes available: release round trip; until a stats reply shows reserved dropped",
                    f"{_ms(release)}; {_ms(visible)}", f"llama_free {_ms(free)}", f"{release / free:.1f}x time"))
    rows.append(Row("5", "  workers' USS still held after release (vs before the admission), by n_ctx",
                    "; ".join(f"{n_ctx}: {_mib(value):+.1f} MiB" for n_ctx, value in kept.items()), "", ""))
    evict = _median(admission["evict_admit_s"])
    admit_2048 = _median(admission["admit_s"]["2048"]) if "2048" in admission["admit_s"] else math.nan
    summary.update({"s5_evict_admit_s": evict, "s5_evictions_counted": admission["evictions_counted"]})
    rows.append(Row("5", f"LRU eviction + admission, n_ctx 2048, all {SESSIONS} workers bound ({admission['evictions_counted']} evictions counted)",
                    _ms(evict), f"admit on a free worker {_ms(admit_2048)}", f"{evict / admit_2048:.2f}x time"))

    memory = results["memory"]
    for n_ctx in results["options"]["admit_n_ctx"]:
        figures = memory["per_session"][str(n_ctx)]
        charged, theory, growth = figures["charged_bytes"], figures["theoretical_kv_bytes"], figures["uss_growth_bytes"]
        summary.update({f"s6_charged_{n_ctx}_bytes": charged, f"s6_theory_{n_ctx}_bytes": theory, f"s6_uss_growth_{n_ctx}_bytes": growth})
        held = figures["held_before_bytes"]
        summary[f"s6_held_before_{n_ctx}_bytes"] = held
        rows.append(Row("6", f"one session n_ctx {n_ctx}: charged; measured worker USS growth (the worker held {_mib(held):+.1f} MiB over its "
                             "start-up USS before) vs theoretical KV (n_ctx x 30 layers x (k+v) x f16)",
                        f"{_mib(charged):.1f} MiB; {_mib(growth):.1f} MiB", f"{_mib(theory):.1f} MiB",
                        f"{charged / theory:.2f}x; {growth / theory:.2f}x"))
    totals = memory["daemon_uss_bytes"]
    n_ctx = memory["daemon_sessions_n_ctx"]
    per_added = (totals[str(SESSIONS)] - totals["0"]) / SESSIONS
    theory = n_ctx * memory["kv_bytes_per_position"]
    summary.update({f"s6_daemon_uss_{count}_bytes": value for count, value in totals.items()})
    rows.append(Row("6", f"whole-model daemon USS (supervisor + {SESSIONS} workers) at 0 / 1 / {SESSIONS} sessions of n_ctx {n_ctx}",
                    " / ".join(f"{_mib(totals[key]):.0f}" for key in ("0", "1", str(SESSIONS))) + " MiB",
                    f"+{_mib(theory):.1f} MiB KV per session", f"+{_mib(per_added):.1f} MiB per session = {per_added / theory:.2f}x"))
    return summary, rows


def render_table(rows: Sequence[Row]) -> str:
    lines = ["| # | measurement | kvpool | reference | ratio | target |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.section} | {r.what} | {r.kvpool} | {r.reference} | {r.ratio} | {r.target} |" for r in rows]
    return "\n".join(lines)


def write_chart(results: dict, summary: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(2, 3, figsize=(16, 9))

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
        axes[1][2].bar([i + (offset - 1) * width for i in range(len(sizes))], [_mib(summary[key.format(n)]) for n in sizes], width, label=label, color=color)
    axes[1][2].set_xticks(range(len(sizes)), [f"n_ctx {n}" for n in sizes])
    axes[1][2].set_title("6  memory per session (whole model)", fontsize=10)
    axes[1][2].set_ylabel("MiB")
    axes[1][2].legend(fontsize=8)
    figure.suptitle(f"kvpool vs llama.cpp, {results['environment']['date_utc']} (medians; kvpool blue, references grey)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=72)
    pyplot.close(figure)


def environment(source: pathlib.Path) -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "uname": " ".join(platform.uname()),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "model": str(source),
        "model_sha256": file_sha256(source),
        "load_average_at_start": os.getloadavg(),
    }


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine spent running code since boot (user, nice, system, interrupts)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0.0) + getattr(times, "softirq", 0.0)


def _own_tree_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _jsonable(value):
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, pathlib.Path):
        return str(value)
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def run_bench(options: BenchOptions) -> tuple[dict, str]:
    """Run every section; write <out>/bench[-quick].{json,png}; return the results and the table."""
    env = environment(options.model)
    started = time.perf_counter()
    busy_before, ours_before = _busy_cpu_s(), _own_tree_cpu_s()
    rig = Rig(options)
    try:
        results = {
            "environment": env,
            "options": dataclasses.asdict(options),
            "daemons": {"start_s": rig.daemon_start_s, "options": rig.daemon_options},
        }
        _say("section 1 and 4: the middle shard, one session")
        results["mid_shard"] = measure_mid_shard(rig)
        _say("section 2: one session through the whole route")
        results["route"] = measure_route(rig, [rig.client(f"chain{index}") for index in range(len(rig.shards))], rig.client("whole"))
        _say("section 3: four sessions at once")
        results["parallel"] = measure_parallel(rig)
        _say("section 5: admission and reclaim")
        results["admission"] = measure_admission(rig)
        _say("section 6: memory")
        results["memory"] = measure_memory(rig)
    finally:
        rig.close()
    results = _jsonable(results)
    env["load_average_at_end"] = os.getloadavg()
    env["wall_s"] = time.perf_counter() - started
    # every process this run started has been waited for by now, so its CPU time is in ours
    env["other_processes_cpu_s"] = (_busy_cpu_s() - busy_before) - (_own_tree_cpu_s() - ours_before)
    results["environment"] = _jsonable(env)
    _say(f"run took {env['wall_s']:.0f} s; other processes used {env['other_processes_cpu_s']:.1f} CPU-seconds meanwhile; "
         f"load average at start {env['load_average_at_start'][0]:.2f}")
    summary, rows = summarize(results)
    table = render_table(rows)
    results["summary"] = summary
    results["table"] = table
    options.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "bench-quick" if options.quick else "bench"
    json_path = options.out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    _say(f"wrote {json_path}")
    if options.chart:
        chart_path = options.out_dir / f"{stem}.png"
        write_chart(results, summary, chart_path)
        _say(f"wrote {chart_path}")
    return results, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute): few rounds and steps")
    parser.add_argument("--model", type=pathlib.Path, help="source GGUF (default: the bundled model)")
    parser.add_argument("--out", type=pathlib.Path, help="output folder (default: <work dir>/bench)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the one-session sections (default 7, quick 2)")
    parser.add_argument("--decode-steps", type=int, help="timed decode steps per round (default 96, quick 8)")
    parser.add_argument("--parallel-rounds", type=int, help="interleaved rounds of the four-session section (default 7, quick 1)")
    parser.add_argument("--parallel-steps", type=int, help="decode steps per session per round (default 64, quick 8)")
    parser.add_argument("--repeats", type=int, help="admissions/releases/evictions per size (default 11, quick 2)")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG chart")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    model = (args.model or bundled_model_path()).resolve()
    out_dir = (args.out or work_dir() / "bench").resolve()
    base = BenchOptions.quick_run(out_dir, model) if args.quick else BenchOptions(out_dir=out_dir, model=model)
    overrides = {
        field: value
        for field, value in (("rounds", args.rounds), ("decode_steps", args.decode_steps), ("parallel_rounds", args.parallel_rounds),
                             ("parallel_steps", args.parallel_steps), ("repeats", args.repeats))
        if value is not None
    }
    return dataclasses.replace(base, chart=not args.no_chart, **overrides)


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    _, table = run_bench(options)
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))

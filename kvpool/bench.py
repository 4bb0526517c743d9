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
import contextlib
import ctypes
import dataclasses
import datetime
import json
import math
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
ROUTE_N_CTX = 1024  # context of the decode and prefill sessions
MID_SESSION = "bench-mid"
EPOCH = 1
PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright while it moves.",
    "List three reasons why people keep houseplants, with one sentence each.",
    "Describe the water cycle to a ten-year-old.",
)
FILLER_TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. " * 80


def _say(message: str) -> None:
    print(f"kvpool bench: {message}", file=sys.stderr, flush=True)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _mib(value: float) -> float:
    return value / 1024**2


@dataclasses.dataclass(frozen=True, slots=True)
class BenchOptions:
    """What one run measures; `quick()` is the short run the test uses."""

    out_dir: pathlib.Path
    model: pathlib.Path
    quick: bool = False
    rounds: int = 5  # interleaved rounds of the single-session sections
    decode_steps: int = 64  # timed decode steps per round and variant
    history: int = 64  # rows in the middle shard's context before its decode steps
    prefill_rows: int = 512
    parallel_rounds: int = 3
    parallel_steps: int = 48  # decode steps per session per round in section 3
    repeats: int = 9  # admissions, releases and evictions measured per size
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


def round_trips(client: Client, session: str, length: int, count: int) -> dict[str, list[float]]:
    """A request the supervisor answers alone (release of an unknown session), and one that goes to
    the session's worker and back (truncate to the current length): IPC without compute or payload."""
    times: dict[str, list[float]] = {"supervisor": [], "worker": []}
    for _ in range(count):
        times["supervisor"].append(_timed(lambda: client.release("bench-no-such-session", EPOCH)))
        times["worker"].append(_timed(lambda: client.truncate(session, EPOCH, length)))
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


class MidShardVariant:
    """reset() empties the session's context; append(start, hidden rows)."""

    def __init__(self, reset: Callable[[], None], append: Callable[[int, np.ndarray], object]) -> None:
        self.reset = reset
        self.append = append


def mid_shard_variants(rig: Rig, client: Client) -> tuple[dict[str, MidShardVariant], Callable[[], None]]:
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
        "daemon": MidShardVariant(daemon_reset, daemon_append),
        "runtime": MidShardVariant(lambda: runtime.truncate(0), lambda start, rows: runtime.append(start, hidden=rows)),
        "llama.cpp": MidShardVariant(plain.reset, plain.append),
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
    trips: dict[str, list[float]] = {"supervisor": [], "worker": []}
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
            for kind, values in round_trips(client, MID_SESSION, options.prefill_rows, max(8, steps // 2)).items():
                trips[kind].extend(values)
            _say(f"middle shard: round {round_index + 1}/{options.rounds}")
    finally:
        close()
    payload = payload_seconds(hidden[:1], rig.middle.n_embd, count=200)
    return {"decode_s": decode, "prefill_s": prefill, "round_trip_s": trips, "payload_s": payload}


# ---- section 2: one session through the whole route -------------------------------------------------


class GreedyVariant:
    """reset(); append(start, token ids) -> last-row logits [1, n_vocab]."""

    def __init__(self, reset: Callable[[], None], append: Callable[[int, Sequence[int]], np.ndarray]) -> None:
        self.reset = reset
        self.append = append


def route_variants(rig: Rig, chain_clients: list[Client], whole_client: Client) -> tuple[dict[str, GreedyVariant], Callable[[], None]]:
    whole = PlainContext(rig.whole_model, ROUTE_N_CTX, n_threads=SINGLE_THREADS)
    local = rig.chain.new_session(ROUTE_N_CTX)
    route = DaemonRoute(chain_clients)
    chain_session, whole_session = "bench-route-chain", "bench-route-whole"
    used: set[str] = set()

    def daemon_variant(session: str, reset_clients: list[Client], append) -> GreedyVariant:
        def reset() -> None:
            if session in used:
                for client in reset_clients:
                    client.truncate(session, EPOCH, 0)

        def append_tokens(start: int, tokens: Sequence[int]) -> np.ndarray:
            used.add(session)
            return append(start, tokens)

        return GreedyVariant(reset, append_tokens)

    variants = {
        "llama.cpp whole": GreedyVariant(whole.reset, lambda start, tokens: whole.append(start, np.asarray(tokens, dtype=np.int32))),
        "in-process chain": GreedyVariant(lambda: local.truncate(0), lambda start, tokens: local.append(start, tokens)),
        "daemon chain": daemon_variant(chain_session, chain_clients, lambda start, tokens: route.append(chain_session, EPOCH, start, tokens)),
        "daemon whole": daemon_variant(whole_session, [whole_client], lambda start, tokens: whole_client.append(whole_session, EPOCH, start, tokens=list(tokens), n_ctx=ROUTE_N_CTX).rows),
    }

    def close() -> None:
        whole.close()
        local.close()
        route.release(chain_session, EPOCH)
        whole_client.release(whole_session, EPOCH)

    return variants, close


def _greedy_run(variant: GreedyVariant, prompt: Sequence[int], steps: int, times: list[float] | None) -> list[int]:
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
    trips: list[dict[str, list[float]]] = [{"supervisor": [], "worker": []} for _ in chain_clients]
    try:
        for name, variant in variants.items():
            tokens[name] = _greedy_run(variant, prompt, min(steps, 16), None)  # warm-up; the tokens are compared
        for round_index, order in _interleaved(options.rounds, list(variants)):
            for name in order:
                _greedy_run(variants[name], prompt, steps, times[name])
            length = len(prompt) + steps
            for index, client in enumerate(chain_clients):
                for kind, values in round_trips(client, "bench-route-chain", length, max(8, steps // 2)).items():
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


def _parallel_kvpool(appenders: list[Callable[[int, Sequence[int]], np.ndarray]], prompts: list[list[int]], steps: int) -> float:
    """Each session in its own thread (as four routers' requests arrive): prefill, wait for all, then
    `steps` greedy decode steps. Aggregate decode tokens/s from the common start to the last finish."""
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
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return len(appenders) * steps / (max(finished) - started)


def _parallel_batched(batched: BatchedContext, prompts: list[list[int]], steps: int) -> float:
    tokens = batched.prefill(prompts)
    positions = [len(prompt) for prompt in prompts]
    started = time.perf_counter()
    for _ in range(steps):
        tokens = batched.step(tokens, positions)
        positions = [position + 1 for position in positions]
    return len(prompts) * steps / (time.perf_counter() - started)


def _capped(limiter: threading.Semaphore | None, function: Callable[[], object]):
    if limiter is None:
        return function()
    with limiter:
        return function()


def measure_parallel(rig: Rig) -> dict:
    options = rig.options
    prompts = [list(prompt) for prompt in rig.prompts[:SESSIONS]]
    whole_clients = [rig.client("whole") for _ in range(SESSIONS)]
    chain_clients = [[rig.client(f"chain{index}") for index in range(len(rig.shards))] for _ in range(SESSIONS)]
    batched = {
        "llama.cpp batched, unified KV": BatchedContext(rig.whole_model, SESSIONS, ROUTE_N_CTX, n_threads=PARALLEL_THREADS, unified=True),
        "llama.cpp batched, KV stream per sequence": BatchedContext(rig.whole_model, SESSIONS, ROUTE_N_CTX, n_threads=PARALLEL_THREADS, unified=False),
    }
    cap = threading.Semaphore(PARALLEL_THREADS)
    round_counter = [0]

    def whole_appenders(tag: str) -> list:
        return [
            (lambda client, session: lambda start, tokens: client.append(session, EPOCH, start, tokens=list(tokens), n_ctx=ROUTE_N_CTX).rows)(
                whole_clients[index], f"bench-par-{tag}-{index}")
            for index in range(SESSIONS)
        ]

    def chain_appenders(tag: str, limiter: threading.Semaphore | None) -> list:
        def appender(clients: list[Client], session: str):
            def append(start: int, tokens: Sequence[int]) -> np.ndarray:
                first, *rest = clients
                rows = _capped(limiter, lambda: first.append(session, EPOCH, start, tokens=list(tokens))).rows
                for client in rest:
                    rows = _capped(limiter, lambda: client.append(session, EPOCH, start, hidden=rows)).rows
                return rows
            return append
        return [appender(chain_clients[index], f"bench-par-{tag}-{index}") for index in range(SESSIONS)]

    def release(tag: str, clients_per_session: list[list[Client]]) -> None:
        for index, clients in enumerate(clients_per_session):
            for client in clients:
                client.release(f"bench-par-{tag}-{index}", EPOCH)

    def kvpool_variant(make: Callable[[str], list], clients_per_session: list[list[Client]], steps: int) -> float:
        round_counter[0] += 1
        tag = str(round_counter[0])
        try:
            return _parallel_kvpool(make(tag), prompts, steps)
        finally:
            release(tag, clients_per_session)

    runners: dict[str, Callable[[int], float]] = {
        **{name: (lambda context: lambda steps: _parallel_batched(context, prompts, steps))(context) for name, context in batched.items()},
        "kvpool whole model, 1 daemon": lambda steps: kvpool_variant(whole_appenders, [[c] for c in whole_clients], steps),
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
        for context in batched.values():
            context.close()
    return {"tokens_per_s": rates}


# ---- sections 5 and 6: admission, reclaim, memory (whole-model daemon) --------------------------------


def measure_admission(rig: Rig) -> dict:
    options = rig.options
    client = rig.client("whole")
    token = rig.prompts[0][:1]
    results: dict[str, dict] = {"first_admit_s": {}, "admit_s": {}, "release_s": {}, "reclaim_visible_s": {},
                                "uss_returned": {}, "bare_create_s": {}, "bare_free_s": {}, "inprocess_admit_s": {}}
    counter = iter(range(10**9))

    def admit(n_ctx: int) -> tuple[str, float]:
        session = f"bench-admit-{next(counter)}"
        elapsed = _timed(lambda: client.append(session, EPOCH, 0, tokens=token, n_ctx=n_ctx))
        return session, elapsed

    calibrated_at_start = rig.options.max_n_ctx
    for n_ctx in options.admit_n_ctx:
        session, first = admit(n_ctx)
        client.release(session, EPOCH)
        results["first_admit_s"][n_ctx] = None if n_ctx == calibrated_at_start else first
        admits, releases, visible, returned = [], [], [], []
        for _ in range(options.repeats):
            before = client.stats().budget.reserved_bytes
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
            returned.append(all(w.uss_bytes - w.baseline_uss_bytes < rig.whole_model.kv_bytes_per_position() * n_ctx / 2 for w in stats.workers))
        results["admit_s"][n_ctx] = admits
        results["release_s"][n_ctx] = releases
        results["reclaim_visible_s"][n_ctx] = visible
        results["uss_returned"][n_ctx] = all(returned)
        # in-process: a bare llama context (create, free) and the worker runtime's create + 1-token append
        create, free, inprocess = [], [], []
        for _ in range(options.repeats):
            started = time.perf_counter()
            plain = PlainContext(rig.whole_model, n_ctx, n_threads=SINGLE_THREADS)
            create.append(time.perf_counter() - started)
            free.append(_timed(plain.close))
            started = time.perf_counter()
            context = rig.whole_model.new_context(n_ctx)
            context.append(0, tokens=np.asarray(token, dtype=np.int32))
            inprocess.append(time.perf_counter() - started)
            context.close()
        results["bare_create_s"][n_ctx] = create
        results["bare_free_s"][n_ctx] = free
        results["inprocess_admit_s"][n_ctx] = inprocess
        _say(f"admission: n_ctx {n_ctx} done")

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
        before = {worker.pid: worker.uss_bytes for worker in client.stats().workers}
        session = f"bench-memory-{n_ctx}"
        client.append(session, EPOCH, 0, tokens=prompt, n_ctx=n_ctx)
        stats = client.stats()
        row = next(row for row in stats.sessions if row.session_id == session)
        after = next(worker.uss_bytes for worker in stats.workers if worker.pid == row.worker_pid)
        per_session[n_ctx] = {
            "charged_bytes": row.charged_bytes,
            "theoretical_kv_bytes": n_ctx * per_position,
            "uss_growth_bytes": after - before[row.worker_pid],
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

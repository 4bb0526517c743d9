"""What the bench runs on: the daemons, models, clients and inputs of one run (`Rig`), and the timing
helpers every section uses."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import psutil

from kvpool.bench.options import EPOCH, PARALLEL_THREADS, ROUTE_N_CTX, SESSIONS, SINGLE_THREADS, BenchOptions, bench_say, median_of
from kvpool.client.client import Client
from kvpool.launcher import Daemon
from kvpool.local.chain import LocalChain
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.cache import shards_in_parts
from kvpool.shard.header import ShardInfo
from kvpool.wire.protocol import Append, AppendReply, decode_reply, decode_request, encode
from workers.runtime.model import ShardModel

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright while it moves.",
    "List three reasons why people keep houseplants, with one sentence each.",
    "Describe the water cycle to a ten-year-old.",
)
FILLER_TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. " * 80


# ---- what the bench runs on -------------------------------------------------------------------------


class Rig:
    """The daemons, in-process models, clients and inputs of one run; close() tears all down. With `one_session`
    only what sections 1, 2 and 4 use (`--only decode`): the mid, chain and whole daemons, not section 3's
    batched ones."""

    def __init__(self, options: BenchOptions, *, one_session: bool = False) -> None:
        self.options = options
        self.one_session = one_session
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
        self.shards: list[ShardInfo] = shards_in_parts(source, 3, progress=bench_say)
        self.middle = self.shards[1]
        # each daemon's --threads and --threads-per-worker below, once; --keep-warm (default 1 s): the machine is the route's (bench help)
        common = ["--ttl", "600", "--keep-warm", repr(options.keep_warm_s)]
        batched = ["--mode", "batched", "--seqs-per-worker", str(SESSIONS), "--max-sessions", str(SESSIONS)]
        route = [*common, "--n-ctx", str(ROUTE_N_CTX)]
        # sections 1, 2 and 4 alone (--only decode) at options.threads a context; a whole run's chain daemons are
        # section 3's too, at 1 thread (the command line refuses --threads there); the measurements record what ran
        threads = options.threads if self.one_session else SINGLE_THREADS
        single = ["--threads", str(threads), "--threads-per-worker", str(threads)]
        plan = {
            "mid": (self.middle.path, [*route, *single, "--max-sessions", "1"]),
            **{f"chain{index}": (shard.path, [*route, *single, "--max-sessions", str(SESSIONS)]) for index, shard in enumerate(self.shards)},
            # section 3's batched mode: one worker process per daemon holds the four sessions as sequences
            **{f"chainb{index}": (shard.path, [*route, *batched, "--threads", "1", "--threads-per-worker", "1"]) for index, shard in enumerate(self.shards)},
            "wholeb": (source, [*route, *batched, "--threads", str(PARALLEL_THREADS), "--threads-per-worker", str(PARALLEL_THREADS)]),
            # section 5 measures eviction itself: no warm tier, no residency wait for the sessions it has just admitted
            "whole": (source, [*common, "--threads", str(max(PARALLEL_THREADS, threads)), "--threads-per-worker", str(threads), "--max-sessions", str(SESSIONS),
                              "--n-ctx", str(options.max_n_ctx), "--budget", "2GiB", "--spill-budget", "0", "--min-residency", "0"]),
        }
        if self.one_session:
            plan = {name: entry for name, entry in plan.items() if not name.startswith(("chainb", "wholeb"))}
        self.daemon_options = {name: options_ for name, (_path, options_) in plan.items()}
        bench_say(f"starting {len(plan)} daemons ({sum(int(o[o.index('--max-sessions') + 1]) for _p, o in plan.values())} workers), sockets in {self.socket_dir}")
        started = time.perf_counter()
        self.daemons = start_daemons(plan, self.socket_dir, self._stack)
        self.daemon_start_s = time.perf_counter() - started
        bench_say(f"daemons ready in {self.daemon_start_s:.1f} s")
        self.daemon_uss_at_start = daemon_uss(self.daemons["whole"])

        self.tokenizer = self._stack.enter_context(Tokenizer(source))
        self.prompts = [self.tokenizer.encode(self.tokenizer.chat_prompt(text)) for text in PROMPTS]
        self.threads = threads
        self.whole_model = self._stack.enter_context(ShardModel(source, n_threads=threads))
        self.mid_model = self._stack.enter_context(ShardModel(self.middle.path, n_threads=threads))
        self.chain = self._stack.enter_context(LocalChain([shard.path for shard in self.shards], n_threads=threads))
        needed = max(options.prefill_rows, options.history + options.decode_steps + options.cold_steps + 8)
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


def start_daemons(plan: dict[str, tuple[pathlib.Path, list[str]]], socket_dir: pathlib.Path, stack: contextlib.ExitStack) -> dict[str, Daemon]:
    """Start one daemon per plan entry (name: shard, options) at <socket_dir>/<name>.sock, all at once, and
    wait until every one answers; each is stopped when `stack` closes (also after a failed start)."""
    daemons: dict[str, Daemon] = {}
    for name, (path, daemon_options) in plan.items():
        daemon = Daemon(path, socket_dir / f"{name}.sock", daemon_options)
        daemons[name] = daemon
        stack.callback(daemon.stop)
    for daemon in daemons.values():
        daemon.wait_ready()
    return daemons


def long_history(tokenizer: Tokenizer, prompt: Sequence[int], needed: int) -> list[int]:
    """`needed` tokens: the prompt, then the filler text repeated."""
    filler = tokenizer.encode(FILLER_TEXT, add_special=False)
    return (list(prompt) + filler * (needed // len(filler) + 1))[:needed]


def daemon_uss(daemon: Daemon) -> int:
    """USS of the daemon's process tree: supervisor, workers, resource tracker (its --keep-warm spinners left out:
    Daemon.worker_pids)."""
    total = 0
    for pid in (daemon.process.pid, *daemon.worker_pids()):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += psutil.Process(pid).memory_full_info().uss
    return total


def time_call(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def run_interleaved(rounds: int, names: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
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
        times["supervisor"].append(time_call(lambda: client.release("bench-no-such-session", EPOCH)))
        times["worker"].append(time_call(lambda: client.truncate(session, EPOCH, length)))
        time.sleep(idle_s)
        times["worker_after_idle"].append(time_call(lambda: client.truncate(session, EPOCH, length)))
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
    return median_of(times)

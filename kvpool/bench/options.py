"""What one bench run measures (`BenchOptions`), the constants its sections share, and small helpers."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

from kvpool.daemon.keep_warm import check_keep_warm

SESSIONS = 4
PARALLEL_THREADS = 2  # llama threads computing at once in section 3 (the machine's cores)
SINGLE_THREADS = 1  # llama threads of a single-session context (sections 1, 2 and 4: BenchOptions.threads, --threads)
MAX_THREADS = 64  # --threads at most
BENCH_KEEP_WARM_S = 1.0  # the daemons' --keep-warm in sections 1-5 (--keep-warm; kvpool serve's default is 0: off)
ROUTE_N_CTX = 1024  # context of the decode and prefill sessions
WARM_N_CTX = 2048 + 64  # section 7's daemons: a 2048-token session and its decodes fit
# section 7's park + restore cycles per round, on the one session (kvpool.bench.warm): three parks at once share 2 cores,
# and their time spreads from 10 to 31 ms at 512 tokens (evidence/warm-tier/README.md, "Stop 38"): a median of 3 rounds
# did not pin it. PARK_CYCLES restore with the decode, on each daemon in turn (the restore travels with the append);
# REQUEST_CYCLES, taking turns with them, with Restore on every daemon at once first (kvpool.router.route.Route.restore:
# answered with each daemon's channel bound, the decode goes direct); then LOADED_CYCLES restore with the decode after
# the workers sat idle past workers.server.single.IDLE_ZERO_S: their spares zeroed, the state is loaded from the store,
# where the others resume the cells their park left (Restored.in_place)
PARK_CYCLES = 5
REQUEST_CYCLES = PARK_CYCLES
LOADED_CYCLES = 2
WARM_DECODE_POSITIONS = 2 * (PARK_CYCLES + REQUEST_CYCLES + LOADED_CYCLES)  # each cycle's decode and the hot one after it
DURABLE_N_CTX = 2048 + 64  # section 10's daemon: a 2048-token session and its next token fit
MOVE_N_CTX = 2048 + 64  # section 11's daemons: the same
# section 12's daemons and llama.cpp reference: a 1,056-token prompt in a chat-sized context, the size of sections 7,
# 10 and 11's daemons so that the charge probe's readings their first start kept serve these (same shards and mode)
PREFIX_N_CTX = 2048 + 64
EPOCH = 1


def bench_say(message: str) -> None:
    print(f"kvpool bench: {time.strftime('%H:%M:%S', time.gmtime())} {message}", file=sys.stderr, flush=True)


def write_results(results: dict, path: pathlib.Path, copy_to: pathlib.Path | None) -> None:
    """A run's results as JSON at `path`, and a copy at `copy_to` (--json) when given; each said."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    bench_say(f"wrote {path}")
    if copy_to is not None:
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        copy_to.write_text(path.read_text())
        bench_say(f"wrote {copy_to}")


def check_threads(count: int) -> int:
    """The one rule of --threads (BenchOptions.threads): 1 to MAX_THREADS llama threads a context."""
    if not 1 <= count <= MAX_THREADS:
        raise ValueError(f"--threads takes 1 to {MAX_THREADS} (got {count})")
    return count


def median_of(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def as_mib(value: float) -> float:
    return value / 1024**2


@dataclasses.dataclass(frozen=True, slots=True)
class BenchOptions:
    """What one run measures; `quick_run()` is the short run the test uses."""

    out_dir: pathlib.Path
    model: pathlib.Path
    quick: bool = False
    rounds: int = 7  # interleaved rounds of the single-session sections
    decode_steps: int = 96  # timed decode steps per round and variant
    # sections 1 and 2: the variants take turns every `chunk_steps` timed steps, so a slow spell of the machine (at
    # ~1B every variant's steps, in-process ones too, slow from ~9.5 to ~14 ms for seconds at a time; on an AMD EPYC
    # VM the whole model's step 58-90 ms from one 3-second turn to the next in one context) falls on all of them
    # alike; each turn begins with one step after another variant ran, timed and kept apart (cold)
    chunk_steps: int = 3
    history: int = 64  # rows in the middle shard's context before its decode steps
    prefill_rows: int = 512
    parallel_rounds: int = 7
    parallel_steps: int = 64  # decode steps per session per round in section 3
    repeats: int = 11  # admissions, releases and evictions measured per size
    admit_n_ctx: tuple[int, ...] = (512, 2048, 8192)
    warm_lengths: tuple[int, ...] = (128, 512, 2048)  # section 7: session lengths restored and re-prefilled
    warm_repeats: int = 3  # section 7: rounds per length (each re-prefills the length twice)
    overload_rounds: int = 3  # interleaved rounds of section 7 (each variant once per round)
    overload_steps: int = 32  # greedy decode steps per session in section 7
    durable_sessions: int = 8  # section 10: parked sessions drained and adopted
    durable_lengths: tuple[int, ...] = (512, 2048)  # section 10: histories restored after a restart and re-prefilled
    durable_rounds: int = 2  # section 10: rounds of its three daemon lifetimes
    move_lengths: tuple[int, ...] = (128, 512, 2048)  # section 11: histories moved by a re-plan and replayed
    move_rounds: int = 3  # section 11: interleaved rounds per length (each variant once per round)
    prefix_rounds: int = 7  # section 12: interleaved rounds of its time-to-first-token variants (a new session each)
    prefix_system_tokens: int = 1024  # section 12: the system prompt every session shares
    threads: int = SINGLE_THREADS  # sections 1, 2 and 4 alone (--only decode): llama threads of every computing context, daemons' and references' alike (--threads; a whole run's are 1: section 3 shares the chain)
    keep_warm_s: float = BENCH_KEEP_WARM_S  # sections 1-5: the daemons' --keep-warm (0: their CPUs left to halt between requests)
    chart: bool = True
    json_path: pathlib.Path | None = None  # --json: a copy of the results JSON

    def __post_init__(self) -> None:
        if min(self.rounds, self.decode_steps, self.history, self.prefill_rows, self.parallel_rounds, self.parallel_steps, self.repeats,
               self.warm_repeats, *self.warm_lengths, self.overload_rounds, self.overload_steps, self.durable_sessions, self.durable_rounds, self.move_rounds, self.prefix_rounds) < 1:
            raise ValueError("rounds, steps, history, prefill rows, repeats, warm lengths and durable sessions must be at least 1")
        check_threads(self.threads)
        check_keep_warm(self.keep_warm_s)
        if self.chunk_steps < 1:
            raise ValueError("chunk steps must be at least 1")
        if self.prefill_rows > ROUTE_N_CTX or self.history + self.decode_steps + self.cold_steps + 8 > ROUTE_N_CTX:
            raise ValueError(f"prefill rows and history + decode steps (timed and cold) must fit in n_ctx {ROUTE_N_CTX}")
        if not self.warm_lengths or max(self.warm_lengths) + WARM_DECODE_POSITIONS > WARM_N_CTX:
            raise ValueError(f"warm lengths (at least one) and their {WARM_DECODE_POSITIONS} decodes must fit in n_ctx {WARM_N_CTX}")
        if not self.durable_lengths or min(self.durable_lengths) < 1 or max(self.durable_lengths) + 1 > DURABLE_N_CTX:
            raise ValueError(f"durable lengths (at least one, each at least 1) and their next token must fit in n_ctx {DURABLE_N_CTX}")
        if not 1 <= self.prefix_system_tokens <= PREFIX_N_CTX - 64:
            raise ValueError(f"the prefix system prompt must have 1 to {PREFIX_N_CTX - 64} tokens (n_ctx {PREFIX_N_CTX}, room for a message)")
        if not self.move_lengths or min(self.move_lengths) < 1 or max(self.move_lengths) + 1 > MOVE_N_CTX:
            raise ValueError(f"move lengths (at least one, each at least 1) and their next token must fit in n_ctx {MOVE_N_CTX}")

    @classmethod
    def quick_run(cls, out_dir: pathlib.Path, model: pathlib.Path) -> BenchOptions:
        # every timed figure gets MIN_ROUNDS rounds (a median between a min and a max: kvpool.bench.checks), with
        # fewer steps per round where a round has several, so the run stays about as long; but section 10's
        # round is three daemon lifetimes: it stays at 1 (the run's end lists it among the figures short of 3)
        return cls(out_dir=out_dir, model=model, quick=True, rounds=3, decode_steps=12, history=16,
                   parallel_rounds=3, parallel_steps=4, repeats=3, warm_lengths=(128, 512), warm_repeats=3, overload_rounds=3, overload_steps=3,
                   durable_sessions=4, durable_rounds=1, move_lengths=(128, 512), move_rounds=3, prefix_rounds=3, prefix_system_tokens=512)

    @property
    def cold_steps(self) -> int:
        """Sections 1 and 2: the steps per round and variant that begin a turn (one per `chunk_steps` timed ones)."""
        return -(-self.decode_steps // self.chunk_steps)

    @property
    def max_n_ctx(self) -> int:
        return max(self.admit_n_ctx)

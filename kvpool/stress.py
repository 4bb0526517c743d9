"""`kvpool stress`: concurrent sessions through a chain of shard daemons, fault drills, and the exactness check.

N sessions (one thread each, one Client per daemon each) run a seeded random mix of operations through a
route of `kvpool serve` daemons: chunked prefill, greedy decode, truncate then replay, cancel in the
middle of a long prefill, release and re-open, an epoch bump, and a stale-epoch request. Each session
keeps a log of the operations that took effect; afterwards every log is replayed alone on a fresh chain
of daemons (or in process) and every returned row, every greedy token and the final logits must be
bit-identical. Any difference is cross-talk and fails the run.

Scenarios add faults: a byte budget for fewer sessions than are active (LRU eviction), a short TTL
(expiry), a SIGKILLed worker. After every run each daemon must hold no session of ours, have its
reserved bytes back where they were, balanced books, and its workers' measured memory back within a
stated tolerance.

The operations of each session are seeded; how the sessions' requests interleave is up to the scheduler,
so two runs with one seed issue the same operations per session but not in the same global order.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import hashlib
import os
import pathlib
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import msgspec
import numpy as np
import psutil

from kvpool.bundled import BundledModelMissing, bundled_model_path
from kvpool.chain import LocalChain
from kvpool.client import Client, ConnectionLost, KvpoolError
from kvpool.config import format_bytes, parse_bytes
from kvpool.daemon_route import DaemonRoute
from kvpool.launcher import Daemon, DaemonStartFailed, start_daemons
from kvpool.protocol import ErrorCode, MissReason, StatsReply
from kvpool.shardcache import cached_shards
from kvpool.shardfile import ShardError, even_splits, read_shard_info
from kvpool.tokenizer import Tokenizer

MiB = 1024**2
UNLIMITED_BUDGET = "64GiB"  # scenarios without --budget-for: the budget is no constraint
FILLER_ROWS = 192  # rows of the long prefill that gets cancelled
MIN_FILLER_ROWS = 64
PREFILL_CHUNKS = (1, 2, 3, 5, 8, 13, 16, 24)
CANCEL_DELAY_MAX_S = 0.3  # the long prefill takes ~0.1-0.3 s per daemon: the cancel lands on one of them
LATE_CANCEL_EVERY = 3  # every third cancel (staggered by session) is sent after the append completed
JITTER_MAX_S = 0.003
ADMIT_RETRY_S = 120.0
MAX_REPLAYS_PER_RECOVERY = 200
# After an eviction a router backs off before replaying (random, doubling while it keeps being evicted):
# with more active sessions than the budget holds, immediate replays evict each other forever.
BACKOFF_BASE_S = 0.02
BACKOFF_MAX_DOUBLINGS = 5
SETTLE_TIMEOUT_S = 30.0
IDLE_MARGIN_S = 1.5  # past the TTL: two housekeeping ticks (0.5 s each) and slack
PROGRESS_EVERY_S = 2.0

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea, the wind and a lighthouse keeper who counts the waves at night.",
    "List four fruits.",
    "Why is the sky blue? Answer briefly.",
    "Explain what a hash table is to a ten year old.",
    "Give three tips for writing clear commit messages.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Describe the water cycle in two sentences.",
)
FILLER_TEXT = " ".join(f"The lighthouse log entry number {i} says the sea was calm and the lamp was bright." for i in range(40))


class OpKind(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    TRUNCATE = "truncate"
    CANCEL = "cancel"
    RELEASE = "release_reopen"
    EPOCH_BUMP = "epoch_bump"
    STALE = "stale_epoch"
    IDLE = "idle_expire"


FORCED_KINDS = (OpKind.TRUNCATE, OpKind.CANCEL, OpKind.RELEASE, OpKind.EPOCH_BUMP, OpKind.STALE)
OP_WEIGHTS = {
    OpKind.PREFILL: 0.5,  # and before any other, with probability PREFILL_FIRST, while tokens are pending
    OpKind.DECODE: 0.70,
    OpKind.TRUNCATE: 0.08,
    OpKind.CANCEL: 0.03,
    OpKind.RELEASE: 0.03,
    OpKind.EPOCH_BUMP: 0.03,
    OpKind.STALE: 0.08,
    OpKind.IDLE: 0.0,  # forced only
}
PREFILL_FIRST = 0.8


# ---- options ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StressOptions:
    """One stress run; validated on construction."""

    sessions: int = 4
    ops: int = 40  # operations per session, before the closing prefill + final_tokens decodes
    seed: int = 0
    budget_for: int | None = None  # budget = (budget_for + 0.5) x one session's measured charge, per daemon
    ttl_s: float | None = None
    kill_worker: bool = False
    sockets: tuple[pathlib.Path, ...] = ()  # attach to running daemons instead of starting them
    model: pathlib.Path | None = None
    parts: int = 3
    n_ctx: int = 512
    reference: str = "daemon"  # "daemon": a fresh chain of daemons; "local": kvpool.chain.LocalChain
    final_tokens: int = 4
    sample_interval_s: float = 0.1
    # Measured here: a worker's USS ends up to ~30 MiB above its pre-run value after many context
    # create/free cycles (heap glibc keeps; malloc_trim(0) in the worker brings it to ~2 MiB). 48 MiB
    # stays below the daemon's own recycle margin (--memory-margin, 64 MiB by default).
    uss_tolerance_bytes: int = 48 * MiB
    json_path: pathlib.Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.sessions < 1:
            problems.append("--sessions must be at least 1")
        if self.ops < 0:
            problems.append("--ops must be >= 0")
        if self.budget_for is not None and self.budget_for < 1:
            problems.append("--budget-for must be at least 1")
        if self.ttl_s is not None and self.ttl_s <= 0:
            problems.append("--ttl must be positive")
        if self.parts < 2:
            problems.append("--parts must be at least 2 (a chain)")
        if self.n_ctx < 256:
            problems.append("--n-ctx must be at least 256 (prompt, generation and the cancelled prefill)")
        if self.reference not in ("daemon", "local"):
            problems.append("--reference must be 'daemon' or 'local'")
        if self.final_tokens < 1:
            problems.append("--final-tokens must be at least 1")
        if self.sample_interval_s <= 0:
            problems.append("--sample-interval must be positive")
        if self.sockets and (self.budget_for is not None or self.ttl_s is not None):
            problems.append("--budget-for and --ttl configure the daemons: they need started daemons, not --sockets")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def scenario(self) -> str:
        parts = []
        if self.budget_for is not None:
            parts.append(f"budget-for-{self.budget_for}")
        if self.ttl_s is not None:
            parts.append(f"ttl-{self.ttl_s:g}")
        if self.kill_worker:
            parts.append("kill-worker")
        return "+".join(parts) or "default"

    @property
    def decode_cap(self) -> int:
        """Sessions stop decoding at this many tokens so the closing decodes always fit in n_ctx."""
        return self.n_ctx - self.final_tokens - 1


# ---- the report (also the --json document) --------------------------------------------------------------


class Latency(msgspec.Struct):
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


class Sample(msgspec.Struct):
    t_s: float
    daemon: int
    reserved_bytes: int
    limit_bytes: int
    measured_uss_bytes: int
    sessions: int
    integrity: str


class Verdict(msgspec.Struct):
    name: str
    passed: bool
    detail: str


class SessionSummary(msgspec.Struct):
    session_id: str
    prompt_tokens: int
    ops: dict[str, int]
    appends: int
    resets: int
    recoveries: int
    misses: dict[str, int]
    cancels_landed: int
    cancels_completed: int
    final_epoch: int
    final_length: int
    generated: list[int]
    checked_rows: int
    greedy_checked: int
    final_logits_max_abs_diff: float | None
    mismatches: list[str]
    violations: list[str]
    unexercised: list[str]


class WorkerMemory(msgspec.Struct):
    pid: int
    before_bytes: int
    after_bytes: int
    delta_bytes: int
    compared_to: str  # "pre-run" or "own baseline" (a worker started during the run)
    within_tolerance: bool


class DaemonSummary(msgspec.Struct):
    socket: str
    layers: str
    limit_bytes: int
    session_charge_bytes: int
    peak_reserved_bytes: int
    reserved_before: int
    reserved_after: int
    our_sessions_after: int
    integrity_after: str
    counters: dict[str, int]
    workers: list[WorkerMemory]
    replaced_pids: list[int]


class KillRecord(msgspec.Struct):
    session_id: str
    daemon: int
    pid: int
    epoch: int
    length: int
    reply: str = ""


class StressReport(msgspec.Struct):
    scenario: str
    options: dict[str, object]
    reference: str
    duration_s: float
    ops_by_kind: dict[str, int]
    latency_ms: dict[str, Latency]
    errors_by_code: dict[str, int]
    events: dict[str, int]
    uss_tolerance_bytes: int
    samples: list[Sample]
    sessions: list[SessionSummary]
    daemons: list[DaemonSummary]
    kills: list[KillRecord]
    verdicts: list[Verdict]
    passed: bool


# ---- what a session did: the log that is replayed alone ---------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedAppend:
    start: int
    tokens: tuple[int, ...]
    digest: str  # of the last output row (the logits) the daemons returned
    greedy: bool  # tokens[0] was the argmax of the logits at position start - 1


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedTruncate:
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedReset:
    """The session's state is gone on every daemon (released, evicted, expired, lost, new epoch)."""


LogEntry = LoggedAppend | LoggedTruncate | LoggedReset


def row_digest(row: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(row, dtype="<f4").tobytes()).hexdigest()[:32]


# ---- shared recording --------------------------------------------------------------------------------------


class Recorder:
    """Latencies, error replies and events from every session thread (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latencies: dict[str, list[float]] = {}
        self.errors: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.ops_done = 0

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed_ms = (time.perf_counter() - started) * 1000
            with self._lock:
                self._latencies.setdefault(kind, []).append(elapsed_ms)

    def error(self, error: KvpoolError) -> None:
        key = f"{error.code}/{error.reason}" if error.reason else str(error.code)
        with self._lock:
            self.errors[key] += 1

    def event(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.events[name] += amount

    def op_done(self) -> None:
        with self._lock:
            self.ops_done += 1

    def error_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self.errors.items()))

    def event_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self.events.items()))

    def latency_summary(self) -> dict[str, Latency]:
        with self._lock:
            items = {kind: list(values) for kind, values in self._latencies.items()}
        summary = {}
        for kind, values in sorted(items.items()):
            p50, p90, p99 = np.percentile(values, [50, 90, 99])
            summary[kind] = Latency(len(values), round(float(p50), 3), round(float(p90), 3), round(float(p99), 3), round(max(values), 3))
        return summary


class Sampler:
    """Polls every daemon's stats from its own thread and connections every `interval_s`."""

    def __init__(self, sockets: Sequence[pathlib.Path], interval_s: float) -> None:
        self._sockets = list(sockets)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._started = time.monotonic()
        self.samples: list[Sample] = []
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run, name="kvpool-stress-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def latest(self) -> dict[int, Sample]:
        latest: dict[int, Sample] = {}
        for sample in self.samples[-2 * len(self._sockets) :]:
            latest[sample.daemon] = sample
        return latest

    def _run(self) -> None:
        clients: list[Client] = []
        try:
            clients = [Client(path, timeout_s=30, name="stress-sampler") for path in self._sockets]
            while True:
                for index, client in enumerate(clients):
                    stats = client.stats()
                    self.samples.append(
                        Sample(
                            t_s=round(time.monotonic() - self._started, 3), daemon=index,
                            reserved_bytes=stats.budget.reserved_bytes, limit_bytes=stats.budget.limit_bytes,
                            measured_uss_bytes=stats.budget.measured_uss_bytes, sessions=len(stats.sessions),
                            integrity=stats.integrity,
                        )
                    )
                if self._stop.wait(self._interval_s):
                    return
        except (ConnectionLost, KvpoolError, OSError) as error:
            self.failures.append(f"sampler stopped: {error}")
        finally:
            for client in clients:
                client.close()


# ---- one session -------------------------------------------------------------------------------------------


class ContractViolation(Exception):
    """A daemon answered something the contract does not allow; the run fails."""


@dataclasses.dataclass(slots=True)
class StageFailed(Exception):
    stage: int
    error: KvpoolError


@dataclasses.dataclass(frozen=True, slots=True)
class SessionPlan:
    """Seeded before the run: which operations are forced at which op index, and the kill, if any."""

    forced: tuple[tuple[int, OpKind], ...]
    kill_stage: int | None = None
    kill_from_op: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SessionSetup:
    index: int
    session_id: str
    prompt: tuple[int, ...]
    filler: tuple[int, ...]
    plan: SessionPlan


def build_plans(options: StressOptions, n_stages: int) -> list[SessionPlan]:
    rng = random.Random(f"plans:{options.seed}")
    victim = rng.randrange(options.sessions) if options.kill_worker else None
    plans = []
    for index in range(options.sessions):
        kinds = list(FORCED_KINDS) + ([OpKind.IDLE] if options.ttl_s is not None else [])
        rng.shuffle(kinds)
        low = max(1, options.ops // 5)
        slots = range(low, max(low + len(kinds), options.ops))
        positions = sorted(rng.sample(slots, len(kinds)))
        forced = tuple(zip(positions, kinds))
        if index == victim:
            plans.append(SessionPlan(forced, kill_stage=rng.randrange(n_stages), kill_from_op=rng.randrange(low, max(low + 1, options.ops // 2))))
        else:
            plans.append(SessionPlan(forced))
    return plans


@dataclasses.dataclass(slots=True)
class CancelOutcome:
    late: bool  # sent only after the append returned: must find nothing in flight
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)  # the append returned
    stage: int = -1
    detail: str = ""
    length: int = -1


class SessionDriver:
    """Runs one session's operations through the route; keeps what took effect in `log`.

    State invariant between operations: every daemon holds positions [0, length) of `tokens` for
    (session_id, epoch); `logits` is the last-row output for position length - 1 when known.
    """

    def __init__(self, setup: SessionSetup, clients: Sequence[Client], options: StressOptions, recorder: Recorder) -> None:
        self.setup = setup
        self.session_id = setup.session_id
        self.clients = list(clients)
        self.options = options
        self.recorder = recorder
        self.rng = random.Random(f"session:{options.seed}:{setup.index}")
        self.epoch = 1
        self.tokens: list[int] = list(setup.prompt)
        self.length = 0
        self.logits: np.ndarray | None = None
        self.log: list[LogEntry] = []
        self.stage = -1  # the daemon the current append is at; read by the canceller thread
        self._forced = list(setup.plan.forced)
        self._kill_pending = setup.plan.kill_stage is not None
        self._op_index = 0
        self.kill: KillRecord | None = None
        self.ops: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.appends = self.resets = self.recoveries = 0
        self.cancels_landed = self.cancels_completed = 0
        self.violations: list[str] = []
        self.idle_results: list[str] = []
        self._evicted_in_a_row = 0

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            for self._op_index in range(self.options.ops):
                kind = self._choose()
                with self.recorder.timed(kind):
                    self._perform(kind)
                self.ops[kind] += 1
                self.recorder.op_done()
                time.sleep(self.rng.random() * JITTER_MAX_S)
            self._finish()
        except ContractViolation as violation:
            self.violations.append(str(violation))
        except ConnectionLost as error:
            self.violations.append(f"connection lost (did a daemon die?): {error}")
        except Exception:  # noqa: BLE001 - reported as a failure of this session, the run goes on
            self.violations.append(traceback.format_exc())
        finally:
            with contextlib.suppress(Exception):
                self._release_all()

    def _finish(self) -> None:
        """Complete any pending prefill and decode `final_tokens` more: the compared final logits."""
        self._op_index = sys.maxsize  # past every planned operation: a pending kill happens now
        target = len(self.tokens) + self.options.final_tokens
        for _ in range(MAX_REPLAYS_PER_RECOVERY):
            if self.length < len(self.tokens):
                with self.recorder.timed(OpKind.PREFILL):
                    self._append(self.tokens[self.length :], greedy=False)
            elif self.logits is None:
                self._recover(new_epoch=False, reason="no logits")
            elif len(self.tokens) < target:
                with self.recorder.timed(OpKind.DECODE):
                    self._decode()
            else:
                return
        raise ContractViolation(f"{self.session_id}: could not finish after {MAX_REPLAYS_PER_RECOVERY} steps")

    def _applicable(self, kind: OpKind) -> bool:
        match kind:
            case OpKind.PREFILL:
                return self.length < len(self.tokens)
            case OpKind.DECODE:
                return self.logits is not None and self.length == len(self.tokens) < self.options.decode_cap
            case OpKind.TRUNCATE:
                return self.length >= 2
            case OpKind.CANCEL:
                return self.length > 0 and self.options.n_ctx - self.length - 1 >= MIN_FILLER_ROWS
            case OpKind.STALE | OpKind.EPOCH_BUMP:
                return self.length > 0  # state on every daemon: the bump must miss (new_epoch), stale must be refused
            case OpKind.IDLE:
                return self.options.ttl_s is not None and self.length > 0
        return True

    def _choose(self) -> OpKind:
        for position, (at, kind) in enumerate(self._forced):
            if at <= self._op_index and self._applicable(kind):
                del self._forced[position]
                return kind
        if self._applicable(OpKind.PREFILL) and self.rng.random() < PREFILL_FIRST:
            return OpKind.PREFILL
        kinds = [kind for kind, weight in OP_WEIGHTS.items() if weight > 0 and self._applicable(kind)]
        return self.rng.choices(kinds, [OP_WEIGHTS[kind] for kind in kinds])[0]

    def _perform(self, kind: OpKind) -> None:
        match kind:
            case OpKind.PREFILL:
                chunk = min(len(self.tokens) - self.length, self.rng.choice(PREFILL_CHUNKS))
                self._append(self.tokens[self.length : self.length + chunk], greedy=False)
            case OpKind.DECODE:
                self._decode()
            case OpKind.TRUNCATE:
                self._truncate()
            case OpKind.CANCEL:
                self._cancel_long_prefill()
            case OpKind.RELEASE:
                self._release_all()
                self._reset()
                self.tokens = list(self.setup.prompt)
            case OpKind.EPOCH_BUMP:
                self._bump_epoch()
            case OpKind.STALE:
                self._stale_request()
            case OpKind.IDLE:
                self._idle_until_expired()

    # ---- requests through the route --------------------------------------------------------------------

    def _stage_append(self, stage: int, start: int, tokens: Sequence[int], rows: np.ndarray | None) -> np.ndarray:
        client = self.clients[stage]
        deadline = time.monotonic() + ADMIT_RETRY_S
        while True:
            try:
                if stage == 0:
                    result = client.append(self.session_id, self.epoch, start, tokens=list(tokens), n_ctx=self.options.n_ctx)
                else:
                    result = client.append(self.session_id, self.epoch, start, hidden=rows, n_ctx=self.options.n_ctx)
                return result.rows
            except KvpoolError as error:
                self.recorder.error(error)
                # A router's answer to over_budget at admission: back off and ask again.
                if error.code == ErrorCode.OVER_BUDGET and start == 0 and self.options.budget_for is not None and time.monotonic() < deadline:
                    time.sleep(self.rng.uniform(0.005, 0.03))
                    continue
                raise StageFailed(stage, error) from None

    def _route_append(self, start: int, tokens: Sequence[int], before_stage: Callable[[int], None] | None = None) -> np.ndarray:
        rows: np.ndarray | None = None
        try:
            for stage in range(len(self.clients)):
                if before_stage is not None:
                    before_stage(stage)
                self.stage = stage
                rows = self._stage_append(stage, start, tokens, rows)
        finally:
            self.stage = -1
        assert rows is not None
        return np.array(rows[-1], copy=True)

    def _append(self, tokens: Sequence[int], *, greedy: bool, before_stage: Callable[[int], None] | None = None) -> StageFailed | None:
        start = self.length
        try:
            last = self._route_append(start, tokens, before_stage)
        except StageFailed as failure:
            self._handle_failure(failure)
            return failure
        self._append_took_effect(start, tokens, last, greedy)
        return None

    def _append_took_effect(self, start: int, tokens: Sequence[int], last: np.ndarray, greedy: bool) -> None:
        self._took_effect(start, tokens, last, greedy)
        self._evicted_in_a_row = 0  # progress beyond a replay

    def _took_effect(self, start: int, tokens: Sequence[int], last: np.ndarray, greedy: bool) -> None:
        self.log.append(LoggedAppend(start, tuple(int(t) for t in tokens), row_digest(last), greedy))
        self.length = start + len(tokens)
        self.logits = last
        self.appends += 1

    def _truncate_all(self, length: int, stages: Sequence[int] | None = None) -> bool:
        for stage in range(len(self.clients)) if stages is None else stages:
            try:
                kept = self.clients[stage].truncate(self.session_id, self.epoch, length)
            except KvpoolError as error:
                self.recorder.error(error)
                self._handle_failure(StageFailed(stage, error))
                return False
            if kept != length:
                raise ContractViolation(f"{self.session_id}: truncate({length}) on daemon {stage} answered length {kept}")
        return True

    def _release_all(self) -> None:
        for stage, client in enumerate(self.clients):
            try:
                done = client.release(self.session_id, self.epoch)
            except KvpoolError as error:
                self.recorder.error(error)
                raise ContractViolation(f"{self.session_id}: release on daemon {stage} failed: {error}") from None
            if done.length != 0:
                raise ContractViolation(f"{self.session_id}: release on daemon {stage} answered length {done.length}")

    def _reset(self) -> None:
        self.log.append(LoggedReset())
        self.length = 0
        self.logits = None
        self.resets += 1

    # ---- failures and recovery (what a router does) -----------------------------------------------------

    def _handle_failure(self, failure: StageFailed) -> None:
        error = failure.error
        if error.code == ErrorCode.CACHE_MISS and error.reason in (MissReason.EVICTED, MissReason.EXPIRED, MissReason.WORKER_LOST):
            self.misses[str(error.reason)] += 1
            self._recover(new_epoch=error.reason == MissReason.WORKER_LOST, reason=f"cache_miss/{error.reason}")
        elif error.code == ErrorCode.WORKER_LOST:
            self.misses["worker_lost"] += 1
            self._recover(new_epoch=True, reason="worker_lost")
        else:
            raise ContractViolation(
                f"{self.session_id} epoch {self.epoch}: daemon {failure.stage} answered {error} at length {self.length}"
            )

    def _recover(self, *, new_epoch: bool, reason: str) -> None:
        """Release everywhere, take a new epoch if a worker was lost, and replay the tokens from 0."""
        self.recorder.event(f"recoveries ({reason})")
        evicted = reason.endswith(MissReason.EVICTED)
        for _ in range(MAX_REPLAYS_PER_RECOVERY):
            self.recoveries += 1
            self._release_all()
            if new_epoch:
                self.epoch += 1
            self._reset()
            if evicted:
                self._evicted_in_a_row += 1
                time.sleep(self.rng.uniform(0, BACKOFF_BASE_S * 2 ** min(self._evicted_in_a_row, BACKOFF_MAX_DOUBLINGS)))
            try:
                with self.recorder.timed("replay"):
                    last = self._route_append(0, self.tokens)
            except StageFailed as failure:
                error = failure.error
                if error.code == ErrorCode.CACHE_MISS and error.reason in (MissReason.EVICTED, MissReason.EXPIRED, MissReason.WORKER_LOST):
                    self.misses[str(error.reason)] += 1
                    new_epoch = error.reason == MissReason.WORKER_LOST
                    evicted = error.reason == MissReason.EVICTED
                    continue
                if error.code == ErrorCode.WORKER_LOST:
                    self.misses["worker_lost"] += 1
                    new_epoch = True
                    continue
                raise ContractViolation(f"{self.session_id}: replay from 0 failed on daemon {failure.stage}: {error}") from None
            self._took_effect(0, self.tokens, last, greedy=False)
            return
        raise ContractViolation(f"{self.session_id}: no progress after {MAX_REPLAYS_PER_RECOVERY} replays")

    # ---- operations ---------------------------------------------------------------------------------------

    def _decode(self) -> None:
        assert self.logits is not None
        token = int(np.argmax(self.logits))
        hook = self._kill_before_stage if self._kill_pending and self._op_index >= self.setup.plan.kill_from_op else None
        failure = self._append([token], greedy=True, before_stage=hook)
        if failure is None:
            self.tokens.append(token)
        if self.kill is not None and not self.kill.reply:
            self.kill.reply = "append succeeded" if failure is None else (
                f"{failure.error.code}/{failure.error.reason}" if failure.error.reason else str(failure.error.code)
            )

    def _kill_before_stage(self, stage: int) -> None:
        """SIGKILL the worker serving this session on the planned daemon, mid-way through the route."""
        if stage != self.setup.plan.kill_stage or not self._kill_pending:
            return
        rows = self.clients[stage].stats().sessions
        row = next((r for r in rows if r.session_id == self.session_id and r.epoch == self.epoch), None)
        if row is None:
            return  # not live there right now (evicted): try again on a later decode
        self._kill_pending = False
        self.kill = KillRecord(session_id=self.session_id, daemon=stage, pid=row.worker_pid, epoch=self.epoch, length=self.length)
        os.kill(row.worker_pid, signal.SIGKILL)
        _wait_dead(row.worker_pid)
        self.recorder.event("workers_killed")

    def _truncate(self) -> None:
        keep = self.rng.randrange(1, self.length)
        if not self._truncate_all(keep):
            return
        self.log.append(LoggedTruncate(keep))
        self.length = keep
        self.logits = None
        if self.rng.random() < 0.5:  # roll back generated tokens too: they will be generated again
            self.tokens = self.tokens[: max(keep + 1, len(self.setup.prompt))]

    def _cancel_long_prefill(self) -> None:
        start = self.length
        filler = self.setup.filler[: min(len(self.setup.filler), self.options.n_ctx - start - 1)]
        outcome = CancelOutcome(late=(self.cancels_landed + self.cancels_completed + self.setup.index) % LATE_CANCEL_EVERY == LATE_CANCEL_EVERY - 1)
        delay = self.rng.uniform(0.0, CANCEL_DELAY_MAX_S)
        canceller = threading.Thread(target=self._cancel_later, args=(delay, outcome), name=f"{self.session_id}-cancel", daemon=True)
        canceller.start()
        try:
            last = self._route_append(start, filler)
        except StageFailed as failure:
            outcome.finished.set()
            canceller.join()
            error = failure.error
            if error.code != ErrorCode.CANCELLED:
                self._handle_failure(failure)
                return
            if error.length != start:
                raise ContractViolation(f"{self.session_id}: cancelled append answered length {error.length}, expected {start}") from None
            # The daemons before the cancelled one took the rows: roll them back too.
            if self._truncate_all(start, stages=range(failure.stage)):
                self.cancels_landed += 1
                self.recorder.event(f"cancel landed on daemon {failure.stage}")
            return
        outcome.finished.set()
        canceller.join()
        self.cancels_completed += 1
        self.recorder.event(f"cancel after completion ({outcome.detail or 'not sent'})")
        allowed = {("nothing in flight", start + len(filler))}
        if self.options.budget_for is not None or self.options.ttl_s is not None:
            allowed.add(("no state", 0))  # evicted or expired there since the append completed
        if outcome.late and (outcome.detail, outcome.length) not in allowed:
            raise ContractViolation(f"{self.session_id}: a cancel with nothing in flight answered {outcome.detail!r}, length {outcome.length} (expected {start + len(filler)})")
        logits_before = self.logits
        self._took_effect(start, filler, last, greedy=False)
        # Roll the completed long prefill back: positions [0, start) and their logits are as before.
        if self._truncate_all(start):
            self.log.append(LoggedTruncate(start))
            self.length = start
            self.logits = logits_before

    def _cancel_later(self, delay_s: float, outcome: CancelOutcome) -> None:
        if outcome.late:
            outcome.finished.wait()
            stage = len(self.clients) - 1
        elif outcome.finished.wait(delay_s) or self.stage < 0:
            outcome.detail = "the append had finished"
            return
        else:
            stage = self.stage
        try:
            done = self.clients[stage].cancel(self.session_id, self.epoch)
            outcome.stage, outcome.detail, outcome.length = stage, done.detail, done.length
        except KvpoolError as error:
            outcome.detail = f"cancel answered {error.code}"
        except ConnectionLost as error:
            outcome.detail = f"cancel connection lost: {error}"

    def _bump_epoch(self) -> None:
        """A re-planned route: epoch + 1. Its first request at position > 0 must miss (new_epoch)."""
        self.epoch += 1
        if self.length > 0:
            try:
                self.clients[0].append(self.session_id, self.epoch, self.length, tokens=[self.tokens[0]])
            except KvpoolError as error:
                self.recorder.error(error)
                if error.code != ErrorCode.CACHE_MISS or error.reason != MissReason.NEW_EPOCH:
                    raise ContractViolation(f"{self.session_id}: epoch {self.epoch} at position {self.length} answered {error}, expected cache_miss/new_epoch") from None
            else:
                raise ContractViolation(f"{self.session_id}: epoch {self.epoch} at position {self.length} was accepted without state")
        self._reset()

    def _stale_request(self) -> None:
        """A request at epoch - 1 to one daemon: stale_epoch, and the session there unchanged."""
        stage = self.rng.randrange(len(self.clients))
        client = self.clients[stage]
        stale = self.epoch - 1
        kind = self.rng.choice(("append", "truncate", "release", "cancel"))
        try:
            if kind == "append" and stage == 0:
                client.append(self.session_id, stale, self.length, tokens=[self.tokens[0]])
            elif kind == "append":
                client.append(self.session_id, stale, self.length, hidden=np.zeros((1, client.shard.n_embd), np.float32))
            elif kind == "truncate":
                client.truncate(self.session_id, stale, 0)
            elif kind == "release":
                client.release(self.session_id, stale)
            else:
                client.cancel(self.session_id, stale)
        except KvpoolError as error:
            self.recorder.error(error)
            if error.code != ErrorCode.STALE_EPOCH:
                raise ContractViolation(f"{self.session_id}: stale {kind} (epoch {stale} < {self.epoch}) answered {error}") from None
        else:
            raise ContractViolation(f"{self.session_id}: stale {kind} (epoch {stale} < {self.epoch}) on daemon {stage} was accepted")
        row = next((r for r in client.stats().sessions if r.session_id == self.session_id), None)
        may_be_gone = self.options.budget_for is not None or self.options.ttl_s is not None
        if row is None and not may_be_gone:
            raise ContractViolation(f"{self.session_id}: gone from daemon {stage} after a stale {kind}")
        if row is not None and (row.epoch, row.length) != (self.epoch, self.length):
            raise ContractViolation(f"{self.session_id}: stale {kind} changed daemon {stage}: epoch/length {row.epoch}/{row.length}, expected {self.epoch}/{self.length}")

    def _idle_until_expired(self) -> None:
        """Stay idle past the TTL; the next request must get cache_miss/expired, then replay."""
        assert self.options.ttl_s is not None
        time.sleep(self.options.ttl_s + IDLE_MARGIN_S)
        if self.length < len(self.tokens):
            tokens = self.tokens[self.length : self.length + 1]
        else:
            assert self.logits is not None
            tokens = [int(np.argmax(self.logits))]
        try:
            self.clients[0].append(self.session_id, self.epoch, self.length, tokens=tokens)
        except KvpoolError as error:
            self.recorder.error(error)
            self.idle_results.append(f"{error.code}/{error.reason}" if error.reason else str(error.code))
            if error.code == ErrorCode.CACHE_MISS and error.reason == MissReason.EXPIRED:
                self.misses["expired"] += 1
                self._recover(new_epoch=False, reason="cache_miss/expired")
                return
            raise ContractViolation(f"{self.session_id}: after {self.options.ttl_s + IDLE_MARGIN_S:g} s idle the daemon answered {error}") from None
        self.idle_results.append("not expired")
        raise ContractViolation(f"{self.session_id}: still live on daemon 0 after {self.options.ttl_s + IDLE_MARGIN_S:g} s idle (ttl {self.options.ttl_s:g} s)")

    def unexercised(self) -> list[str]:
        return [str(kind) for _at, kind in self._forced]


def _wait_dead(pid: int, timeout_s: float = 10.0) -> None:
    """Until the process is gone or a zombie (its pipes are closed either way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.002)


# ---- the reference: each session's log, alone ----------------------------------------------------------


class ReferenceChain(Protocol):
    def begin(self) -> None: ...
    def append(self, start: int, tokens: Sequence[int]) -> np.ndarray: ...
    def truncate(self, length: int) -> None: ...
    def end(self) -> None: ...


class DaemonReference:
    """A fresh chain of daemons with one worker each: every replayed session is alone on it."""

    def __init__(self, clients: Sequence[Client]) -> None:
        self.route = DaemonRoute(clients)
        self._count = 0
        self._session_id = ""

    def begin(self) -> None:
        self._count += 1
        self._session_id = f"reference-{self._count}"

    def append(self, start: int, tokens: Sequence[int]) -> np.ndarray:
        return self.route.append(self._session_id, 1, start, tokens)[-1]

    def truncate(self, length: int) -> None:
        self.route.truncate(self._session_id, 1, length)

    def end(self) -> None:
        self.route.release(self._session_id, 1)


class LocalReference:
    """kvpool.chain.LocalChain in this process (same numerics as the daemons)."""

    def __init__(self, shard_paths: Sequence[pathlib.Path], n_ctx: int) -> None:
        self.chain = LocalChain(shard_paths)
        self.n_ctx = n_ctx
        self._session = None

    def begin(self) -> None:
        self._session = self.chain.new_session(self.n_ctx)

    def append(self, start: int, tokens: Sequence[int]) -> np.ndarray:
        assert self._session is not None
        return self._session.append(start, tokens)[-1]

    def truncate(self, length: int) -> None:
        assert self._session is not None
        self._session.truncate(length)

    def end(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def close(self) -> None:
        self.end()
        self.chain.close()


@dataclasses.dataclass(slots=True)
class ReplayOutcome:
    mismatches: list[str]
    checked_rows: int
    greedy_checked: int
    final_row: np.ndarray | None


def replay_alone(log: Sequence[LogEntry], chain: ReferenceChain, label: str) -> ReplayOutcome:
    """Run the log's operations alone; compare every output row digest and every greedy token."""
    mismatches: list[str] = []
    argmax_at: dict[int, int] = {}  # session length -> argmax of the logits for the row before it
    final: np.ndarray | None = None
    checked = greedy = 0
    chain.begin()
    number = -1
    try:
        for number, entry in enumerate(log):
            match entry:
                case LoggedReset():
                    chain.end()
                    chain.begin()
                    argmax_at.clear()
                    final = None
                case LoggedTruncate(length=length):
                    chain.truncate(length)
                    argmax_at = {end: token for end, token in argmax_at.items() if end <= length}
                    final = None
                case LoggedAppend(start=start, tokens=tokens, digest=digest, greedy=is_greedy):
                    if is_greedy:
                        greedy += 1
                        alone = argmax_at.get(start)
                        if alone != tokens[0]:
                            mismatches.append(f"{label} op {number}: greedy token at position {start} was {tokens[0]}, alone {alone}")
                    row = np.array(chain.append(start, tokens), copy=True)
                    checked += 1
                    if row_digest(row) != digest:
                        mismatches.append(f"{label} op {number}: {len(tokens)} row(s) at position {start}: logits differ from the run alone")
                    argmax_at[start + len(tokens)] = int(np.argmax(row))
                    final = row
    except Exception as error:  # noqa: BLE001 - the reference itself failed: nothing to compare against
        mismatches.append(f"{label} op {number}: the run alone failed: {error!r}")
        final = None
    finally:
        with contextlib.suppress(Exception):
            chain.end()
    return ReplayOutcome(mismatches, checked, greedy, final)


# ---- daemons ------------------------------------------------------------------------------------------


def _stop(daemons: Sequence[Daemon]) -> list[int]:
    return [daemon.stop() for daemon in reversed(daemons)][::-1]


def _serve_options(options: StressOptions, *, max_sessions: int, budget: str, ttl_s: float) -> list[str]:
    return [
        "--threads", "1", "--n-ctx", str(options.n_ctx), "--max-sessions", str(max_sessions),
        "--budget", budget, "--ttl", f"{ttl_s:g}",
    ]


def _probe_charges(shards: Sequence[pathlib.Path], socket_dir: pathlib.Path, options: StressOptions, prompt: Sequence[int]) -> list[int]:
    """One session's charge on each daemon, measured by admitting a probe session."""
    daemons = start_daemons(shards, socket_dir, _serve_options(options, max_sessions=1, budget=UNLIMITED_BUDGET, ttl_s=300), prefix="probe")
    try:
        clients = [daemon.client() for daemon in daemons]
        try:
            route = DaemonRoute(clients)
            route.append("stress-probe", 1, 0, prompt)
            charges = [next(row.charged_bytes for row in client.stats().sessions) for client in clients]
            route.release("stress-probe", 1)
            return charges
        finally:
            for client in clients:
                client.close()
    finally:
        _stop(daemons)


# ---- checks after the run ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    stats: StatsReply

    @property
    def uss_by_pid(self) -> dict[int, int]:
        return {worker.pid: worker.uss_bytes for worker in self.stats.workers}


def _snapshot(sockets: Sequence[pathlib.Path]) -> list[Snapshot]:
    snapshots = []
    for path in sockets:
        with Client(path, timeout_s=30, name="stress-check") as client:
            snapshots.append(Snapshot(client.stats()))
    return snapshots


def _worker_memory(before: Snapshot, after: Snapshot, tolerance: int) -> list[WorkerMemory]:
    rows = []
    pre = before.uss_by_pid
    for worker in after.stats.workers:
        if worker.pid in pre:
            reference, compared_to = pre[worker.pid], "pre-run"
        else:
            reference, compared_to = worker.baseline_uss_bytes, "own baseline"
        delta = worker.uss_bytes - reference
        rows.append(WorkerMemory(worker.pid, reference, worker.uss_bytes, delta, compared_to, abs(delta) <= tolerance))
    return rows


def _settled(before: Snapshot, after: Snapshot, prefix: str, tolerance: int, workers_expected: int | None) -> bool:
    stats = after.stats
    ours = [row for row in stats.sessions if row.session_id.startswith(prefix)]
    return (
        not ours
        and stats.budget.reserved_bytes == before.stats.budget.reserved_bytes
        and stats.integrity == "ok"
        and (workers_expected is None or len(stats.workers) == workers_expected)
        and all(row.within_tolerance for row in _worker_memory(before, after, tolerance))
    )


def _settle(sockets: Sequence[pathlib.Path], before: Sequence[Snapshot], prefix: str, tolerance: int, workers_expected: int | None) -> list[Snapshot]:
    """Stats of every daemon once everything is back (or as they are when SETTLE_TIMEOUT_S runs out).

    Evicted sessions' contexts are freed in the background and killed workers are replaced
    asynchronously, so the final state is polled for rather than read once.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = _snapshot(sockets)
        if all(_settled(b, a, prefix, tolerance, workers_expected) for b, a in zip(before, after)) or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


# ---- the run --------------------------------------------------------------------------------------------


Say = Callable[[str], None]


def _stderr_say(message: str) -> None:
    print(f"kvpool stress: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(slots=True)
class Chain:
    """The daemons under test: started here (daemons set) or attached to (sockets only)."""

    sockets: list[pathlib.Path]
    shard_paths: list[pathlib.Path]
    daemons: list[Daemon]
    charges: list[int]
    workers_expected: int | None


def _prompts(tokenizer: Tokenizer, count: int) -> list[tuple[int, ...]]:
    prompts = []
    for index in range(count):
        text = PROMPTS[index % len(PROMPTS)] + (f" (variant {index // len(PROMPTS)})" if index >= len(PROMPTS) else "")
        prompts.append(tuple(tokenizer.encode(tokenizer.chat_prompt(text))))
    return prompts


def _shard_paths_of(sockets: Sequence[pathlib.Path]) -> list[pathlib.Path]:
    paths = []
    for path in sockets:
        with Client(path, timeout_s=30, name="stress-attach") as client:
            paths.append(pathlib.Path(client.shard.model_path))
    return paths


def _open_chain(options: StressOptions, socket_dir: pathlib.Path, prompt: Sequence[int], say: Say, shard_paths: list[pathlib.Path]) -> Chain:
    if options.sockets:
        return Chain(list(options.sockets), shard_paths, [], [], None)
    ttl = options.ttl_s if options.ttl_s is not None else 300.0
    charges: list[int] = []
    if options.budget_for is not None:
        say("measuring one session's charge on each daemon (probe daemons)")
        charges = _probe_charges(shard_paths, socket_dir, options, prompt)
        budgets = [str(int(charge * (options.budget_for + 0.5))) for charge in charges]
        max_sessions = options.sessions
        say("charges " + ", ".join(format_bytes(c) for c in charges) + f": budgets for {options.budget_for} sessions " + ", ".join(format_bytes(int(b)) for b in budgets))
    else:
        budgets = [UNLIMITED_BUDGET] * len(shard_paths)
        max_sessions = options.sessions + 1  # a spare warm worker: a replaced or recycling worker evicts nobody
    serve = [_serve_options(options, max_sessions=max_sessions, budget=budget, ttl_s=ttl) for budget in budgets]
    say(f"starting {len(shard_paths)} daemons: {' '.join(serve[0])}")
    daemons = start_daemons(shard_paths, socket_dir, serve, prefix="shard")
    return Chain([daemon.socket for daemon in daemons], shard_paths, daemons, charges, max_sessions)


def _progress_loop(stop: threading.Event, recorder: Recorder, sampler: Sampler, total_ops: int, started: float, say: Say) -> None:
    while not stop.wait(PROGRESS_EVERY_S):
        latest = sampler.latest()
        reserved = " ".join(f"d{index}={format_bytes(sample.reserved_bytes)}" for index, sample in sorted(latest.items()))
        errors = ", ".join(f"{key} {count}" for key, count in recorder.error_counts().items()) or "none"
        say(f"{time.monotonic() - started:6.1f} s  ops {recorder.ops_done}/{total_ops}  reserved {reserved}  replies with errors: {errors}")


def _run_sessions(options: StressOptions, chain: Chain, setups: Sequence[SessionSetup], recorder: Recorder, sampler: Sampler, say: Say) -> list[SessionDriver]:
    drivers: list[SessionDriver] = []
    all_clients: list[Client] = []
    try:
        for setup in setups:
            clients = [Client(path, name=setup.session_id) for path in chain.sockets]
            all_clients += clients
            drivers.append(SessionDriver(setup, clients, options, recorder))
        threads = [threading.Thread(target=driver.run, name=driver.session_id, daemon=True) for driver in drivers]
        stop = threading.Event()
        progress = threading.Thread(
            target=_progress_loop, args=(stop, recorder, sampler, options.sessions * options.ops, time.monotonic(), say), daemon=True
        )
        progress.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stop.set()
        progress.join()
    finally:
        for client in all_clients:
            client.close()
    return drivers


def _replay_all(options: StressOptions, chain: Chain, drivers: Sequence[SessionDriver], socket_dir: pathlib.Path, say: Say) -> list[ReplayOutcome]:
    if options.reference == "local":
        say("replaying each session alone in process (LocalChain)")
        local = LocalReference(chain.shard_paths, options.n_ctx)
        try:
            return [replay_alone(driver.log, local, driver.session_id) for driver in drivers]
        finally:
            local.close()
    serve = _serve_options(options, max_sessions=1, budget=UNLIMITED_BUDGET, ttl_s=3600)
    say(f"replaying each session alone on a fresh chain of {len(chain.shard_paths)} daemons ({' '.join(serve)})")
    daemons = start_daemons(chain.shard_paths, socket_dir, serve, prefix="reference")
    try:
        clients = [daemon.client() for daemon in daemons]
        try:
            reference = DaemonReference(clients)
            return [replay_alone(driver.log, reference, driver.session_id) for driver in drivers]
        finally:
            for client in clients:
                client.close()
    finally:
        _stop(daemons)


def _session_summary(driver: SessionDriver, replay: ReplayOutcome) -> SessionSummary:
    diff: float | None = None
    mismatches = list(replay.mismatches)
    if driver.logits is not None and replay.final_row is not None and not driver.violations:
        diff = float(np.abs(driver.logits - replay.final_row).max())
        if diff != 0.0:
            mismatches.append(f"{driver.session_id}: final logits differ from the run alone (max |diff| {diff:g})")
    return SessionSummary(
        session_id=driver.session_id, prompt_tokens=len(driver.setup.prompt), ops=dict(sorted(driver.ops.items())),
        appends=driver.appends, resets=driver.resets, recoveries=driver.recoveries, misses=dict(driver.misses),
        cancels_landed=driver.cancels_landed, cancels_completed=driver.cancels_completed,
        final_epoch=driver.epoch, final_length=driver.length, generated=driver.tokens[len(driver.setup.prompt) :],
        checked_rows=replay.checked_rows, greedy_checked=replay.greedy_checked, final_logits_max_abs_diff=diff,
        mismatches=mismatches, violations=driver.violations, unexercised=driver.unexercised(),
    )


def _daemon_summaries(chain: Chain, before: Sequence[Snapshot], after: Sequence[Snapshot], samples: Sequence[Sample], tolerance: int, prefix: str) -> list[DaemonSummary]:
    summaries = []
    for index, (b, a) in enumerate(zip(before, after)):
        shard = a.stats.shard
        peak = max((s.reserved_bytes for s in samples if s.daemon == index), default=0)
        after_pids = {w.pid for w in a.stats.workers}
        summaries.append(
            DaemonSummary(
                socket=str(chain.sockets[index]), layers=f"[{shard.layer_start}, {shard.layer_stop})",
                limit_bytes=a.stats.budget.limit_bytes, session_charge_bytes=chain.charges[index] if chain.charges else 0,
                peak_reserved_bytes=peak, reserved_before=b.stats.budget.reserved_bytes, reserved_after=a.stats.budget.reserved_bytes,
                our_sessions_after=sum(row.session_id.startswith(prefix) for row in a.stats.sessions), integrity_after=a.stats.integrity,
                counters={key: value - b.stats.counters.get(key, 0) for key, value in sorted(a.stats.counters.items()) if key != "peak_concurrent_compute_threads"}
                | {"peak_concurrent_compute_threads": a.stats.counters.get("peak_concurrent_compute_threads", 0)},
                workers=_worker_memory(b, a, tolerance), replaced_pids=sorted(set(b.uss_by_pid) - after_pids),
            )
        )
    return summaries


def _verdicts(options: StressOptions, chain: Chain, drivers: Sequence[SessionDriver], sessions: Sequence[SessionSummary], daemons: Sequence[DaemonSummary], samples: Sequence[Sample], sampler_failures: Sequence[str]) -> list[Verdict]:
    verdicts: list[Verdict] = []

    def add(name: str, passed: bool, detail: str) -> None:
        verdicts.append(Verdict(name, bool(passed), detail))

    violations = [v for s in sessions for v in s.violations]
    add("contract", not violations, "every reply was one the contract allows" if not violations else "; ".join(violations)[:2000])
    mismatches = [m for s in sessions for m in s.mismatches]
    rows = sum(s.checked_rows for s in sessions)
    greedy = sum(s.greedy_checked for s in sessions)
    exact = not mismatches and not violations and all(s.final_logits_max_abs_diff == 0.0 for s in sessions)
    add("exact", exact, f"{rows} output rows, {greedy} greedy tokens and {len(sessions)} final logits identical to each session alone" if exact else "; ".join(mismatches)[:2000] or "a session did not finish")
    if options.ops >= 2 * len(FORCED_KINDS):
        done = Counter()
        for summary in sessions:
            done.update(summary.ops)
        wanted = [str(kind) for kind in FORCED_KINDS] + [str(OpKind.PREFILL), str(OpKind.DECODE)] + ([str(OpKind.IDLE)] if options.ttl_s is not None else [])
        landed = sum(s.cancels_landed for s in sessions)
        completed = sum(s.cancels_completed for s in sessions)
        missing = [kind for kind in wanted if not done[kind]]
        if options.budget_for is None:  # under budget pressure an eviction may cut any cancel short
            missing += (["cancel landing mid-prefill"] if not landed else []) + (["cancel after completion"] if not completed else [])
        add("operations", not missing, ("every kind exercised: " + ", ".join(f"{k} {done[k]}" for k in wanted) + f"; cancels landed mid-prefill {landed}, sent after completion {completed}") if not missing else f"never exercised: {missing}")
    over = [s for s in samples if s.reserved_bytes > s.limit_bytes or s.integrity != "ok"]
    add("books_at_every_sample", not over and bool(samples) and not sampler_failures,
        f"{len(samples)} samples: reserved <= limit and the books balance at each" if not over and samples and not sampler_failures
        else f"{len(over)} bad samples, e.g. {over[0] if over else None}; {list(sampler_failures)}")
    back = all(not d.our_sessions_after and d.reserved_after == d.reserved_before and d.integrity_after == "ok" for d in daemons)
    add("released", back, "no session left, reserved bytes back to " + ", ".join(format_bytes(d.reserved_after) for d in daemons) + ", integrity ok on every daemon"
        if back else "; ".join(f"daemon {i}: {d.our_sessions_after} sessions left, reserved {d.reserved_before} -> {d.reserved_after}, books {d.integrity_after}" for i, d in enumerate(daemons)))
    memory = [(i, w) for i, d in enumerate(daemons) for w in d.workers]
    bad = [(i, w) for i, w in memory if not w.within_tolerance]
    worst = max((abs(w.delta_bytes) for _i, w in memory), default=0)
    add("worker_memory", not bad, f"{len(memory)} workers within {format_bytes(options.uss_tolerance_bytes)} of their pre-run USS (largest |delta| {format_bytes(worst)})"
        if not bad else "; ".join(f"daemon {i} pid {w.pid}: {format_bytes(w.before_bytes)} -> {format_bytes(w.after_bytes)}" for i, w in bad))
    if options.budget_for is not None:
        evictions = [d.counters.get("evictions", 0) for d in daemons]
        evicted_misses = sum(s.misses.get("evicted", 0) for s in sessions)
        peaks = all(d.peak_reserved_bytes <= d.limit_bytes for d in daemons)
        passed = sum(evictions) > 0 and evicted_misses > 0 and peaks and exact
        add("lru_eviction", passed, f"evictions per daemon {evictions}, {evicted_misses} cache_miss/evicted seen and replayed from 0, all exact; "
            f"peak reserved " + ", ".join(f"{format_bytes(d.peak_reserved_bytes)}/{format_bytes(d.limit_bytes)}" for d in daemons))
    if options.ttl_s is not None:
        results = [result for driver in drivers for result in driver.idle_results]
        expirations = [d.counters.get("expirations", 0) for d in daemons]
        passed = bool(results) and all(r == "cache_miss/expired" for r in results) and sum(expirations) >= len(results) and exact
        add("ttl_expiry", passed, f"{len(results)} sessions idle {options.ttl_s + IDLE_MARGIN_S:g} s: next request answered {Counter(results)}; expirations per daemon {expirations}")
    if options.kill_worker:
        kills = [driver.kill for driver in drivers if driver.kill is not None]
        if not kills:
            add("kill_worker", False, "the planned kill never happened (the session never decoded while live)")
        else:
            kill = kills[0]
            victim = next(d for d in drivers if d.kill is kill)
            daemon = daemons[kill.daemon]
            replaced = kill.pid not in {w.pid for w in daemon.workers} and (chain.workers_expected is None or len(daemon.workers) == chain.workers_expected)
            others = [s for s in sessions if s.session_id != victim.session_id]
            others_exact = all(not s.mismatches and not s.violations for s in others)
            reported = kill.reply in ("worker_lost", "cache_miss/worker_lost")
            passed = reported and replaced and others_exact and exact and daemon.counters.get("worker_restarts", 0) >= 1
            add("kill_worker", passed, f"SIGKILL pid {kill.pid} (daemon {kill.daemon}, {kill.session_id} at length {kill.length}): answered {kill.reply}; "
                f"replayed from 0 at epoch {victim.epoch}; worker replaced: {replaced}; other sessions exact: {others_exact} "
                f"(their recoveries: {sum(s.recoveries for s in others)})")
    return verdicts


def run_stress(options: StressOptions, *, say: Say = _stderr_say) -> StressReport:
    """The whole run: set up, drive the sessions, check, replay alone, judge. Raises on setup failure."""
    started = time.monotonic()
    run_prefix = f"stress-{os.getpid()}-{options.seed}-"
    socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-stress-", dir="/tmp"))
    keep_logs = False
    try:
        if options.sockets:
            shard_paths = _shard_paths_of(options.sockets)
        else:
            source = options.model or bundled_model_path()
            total = read_shard_info(source).total_layers
            shard_paths = [shard.path for shard in cached_shards(source, even_splits(total, options.parts), progress=say)]
        with Tokenizer(shard_paths[0]) as tokenizer:
            prompts = _prompts(tokenizer, options.sessions)
            filler = tuple(tokenizer.encode(FILLER_TEXT, add_special=False)[:FILLER_ROWS])
        chain = _open_chain(options, socket_dir, prompts[0], say, shard_paths)
        try:
            plans = build_plans(options, len(chain.sockets))
            setups = [SessionSetup(i, f"{run_prefix}{i}", prompts[i], filler, plans[i]) for i in range(options.sessions)]
            before = _snapshot(chain.sockets)
            recorder = Recorder()
            sampler = Sampler(chain.sockets, options.sample_interval_s)
            sampler.start()
            say(f"{options.sessions} sessions x {options.ops} ops, scenario {options.scenario}, seed {options.seed}")
            try:
                drivers = _run_sessions(options, chain, setups, recorder, sampler, say)
            finally:
                sampler.stop()
            say(f"sessions done in {time.monotonic() - started:.1f} s; waiting for the daemons to settle")
            after = _settle(chain.sockets, before, run_prefix, options.uss_tolerance_bytes, chain.workers_expected)
        finally:
            codes = _stop(chain.daemons)
            if chain.daemons and any(codes):
                keep_logs = True
                say(f"daemon exit codes {codes}: logs kept in {socket_dir}")
        replays = _replay_all(options, chain, drivers, socket_dir, say)
        sessions = [_session_summary(driver, replay) for driver, replay in zip(drivers, replays)]
        daemons = _daemon_summaries(chain, before, after, sampler.samples, options.uss_tolerance_bytes, run_prefix)
        verdicts = _verdicts(options, chain, drivers, sessions, daemons, sampler.samples, sampler.failures)
        ops_by_kind = Counter()
        for driver in drivers:
            ops_by_kind.update(driver.ops)
        report = StressReport(
            scenario=options.scenario,
            options={field.name: _plain(getattr(options, field.name)) for field in dataclasses.fields(options)},
            reference="fresh daemons" if options.reference == "daemon" else "in-process LocalChain",
            duration_s=round(time.monotonic() - started, 3),
            ops_by_kind=dict(sorted(ops_by_kind.items())), latency_ms=recorder.latency_summary(),
            errors_by_code=recorder.error_counts(), events=recorder.event_counts(),
            uss_tolerance_bytes=options.uss_tolerance_bytes, samples=sampler.samples, sessions=sessions, daemons=daemons,
            kills=[driver.kill for driver in drivers if driver.kill is not None], verdicts=verdicts,
            passed=all(verdict.passed for verdict in verdicts),
        )
        keep_logs = keep_logs or not report.passed
        if options.json_path is not None:
            options.json_path.parent.mkdir(parents=True, exist_ok=True)
            options.json_path.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
        return report
    except BaseException:
        keep_logs = True
        raise
    finally:
        if keep_logs and any(socket_dir.glob("*.log")):
            say(f"daemon logs kept in {socket_dir}")
        else:
            shutil.rmtree(socket_dir, ignore_errors=True)


def _plain(value: object) -> object:
    if isinstance(value, pathlib.Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


# ---- the table -----------------------------------------------------------------------------------------


def render(report: StressReport) -> str:
    options = report.options
    lines = [
        f"kvpool stress: scenario {report.scenario}, {options['sessions']} sessions x {options['ops']} ops, seed {options['seed']}, "
        f"n_ctx {options['n_ctx']}, reference: {report.reference}, {report.duration_s:.1f} s",
        "",
        f"{'OPERATION':<16} {'COUNT':>6} {'P50 ms':>9} {'P90 ms':>9} {'P99 ms':>9} {'MAX ms':>9}",
    ]
    for kind, latency in report.latency_ms.items():
        lines.append(f"{kind:<16} {latency.count:>6} {latency.p50_ms:>9.2f} {latency.p90_ms:>9.2f} {latency.p99_ms:>9.2f} {latency.max_ms:>9.2f}")
    errors = ", ".join(f"{key} {count}" for key, count in report.errors_by_code.items()) or "none"
    lines += ["", f"error replies (expected ones included): {errors}"]
    if report.events:
        lines.append("events: " + ", ".join(f"{key} {count}" for key, count in report.events.items()))
    lines += ["", f"{'SESSION':<22} {'OPS':>4} {'APPENDS':>7} {'RESETS':>6} {'RECOV':>5} {'EPOCH':>5} {'LEN':>4} {'ROWS=':>5} {'GREEDY=':>7}  RESULT"]
    for s in report.sessions:
        result = "exact" if not s.mismatches and not s.violations and s.final_logits_max_abs_diff == 0.0 else "FAIL"
        lines.append(
            f"{s.session_id[-22:]:<22} {sum(s.ops.values()):>4} {s.appends:>7} {s.resets:>6} {s.recoveries:>5} {s.final_epoch:>5} "
            f"{s.final_length:>4} {s.checked_rows:>5} {s.greedy_checked:>7}  {result}"
        )
    lines += ["", f"{'DAEMON':<7} {'LAYERS':<9} {'LIMIT':>10} {'PEAK RES':>10} {'RES AFTER':>10} {'EVICT':>5} {'EXPIRE':>6} {'RESTART':>7} {'CANCEL':>6}  WORKER USS max |delta|"]
    for index, d in enumerate(report.daemons):
        worst = max((abs(w.delta_bytes) for w in d.workers), default=0)
        lines.append(
            f"{index:<7} {d.layers:<9} {format_bytes(d.limit_bytes):>10} {format_bytes(d.peak_reserved_bytes):>10} {format_bytes(d.reserved_after):>10} "
            f"{d.counters.get('evictions', 0):>5} {d.counters.get('expirations', 0):>6} {d.counters.get('worker_restarts', 0):>7} "
            f"{d.counters.get('cancels', 0):>6}  {format_bytes(worst)} (tolerance {format_bytes(report.uss_tolerance_bytes)})"
        )
    lines += ["", "VERDICTS"]
    for verdict in report.verdicts:
        lines.append(f"  {'PASS' if verdict.passed else 'FAIL'}  {verdict.name:<22} {verdict.detail}")
    lines += ["", f"RESULT: {'PASS' if report.passed else 'FAIL'}"]
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------------


DESCRIPTION = (
    "Start a chain of `kvpool serve` daemons on the bundled model (or attach to running ones with --sockets) "
    "and drive N concurrent sessions through it with a seeded random mix of chunked prefill, greedy decode, "
    "truncate then replay, cancel in the middle of a long prefill, release and re-open, an epoch bump and a "
    "stale-epoch request. Every session's operations are then replayed alone on a fresh chain of daemons: every "
    "output row, greedy token and the final logits must be bit-identical, or the run fails (exit code 1). "
    "Scenario flags add faults; after each run every daemon must have released everything, balanced its books "
    "and returned its workers' memory within --uss-tolerance. Progress goes to stderr, the table to stdout."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default 4)")
    parser.add_argument("--ops", type=int, default=40, help="operations per session before the closing decodes (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every session's operations (default 0)")
    parser.add_argument("--budget-for", type=int, metavar="K", help="scenario: a budget for K sessions on each daemon (K + 0.5 times one session's measured charge), --sessions active: LRU evictions, cache_miss, replay; reserved bytes never above the limit")
    parser.add_argument("--ttl", type=float, metavar="SECONDS", help="scenario: daemons expire sessions idle this long; each session idles once and must get cache_miss/expired")
    parser.add_argument("--kill-worker", action="store_true", help="scenario: SIGKILL the worker of one session on one daemon mid-decode; it must report worker_lost and recover by replay, the others continue exactly")
    parser.add_argument("--sockets", help="comma-separated daemon sockets, first shard to last: attach instead of starting daemons")
    parser.add_argument("--model", type=pathlib.Path, help="source GGUF to cut into shards (default: the bundled model)")
    parser.add_argument("--parts", type=int, default=3, help="shards, one daemon each (default 3)")
    parser.add_argument("--n-ctx", type=int, default=512, help="context per session (default 512)")
    parser.add_argument("--reference", choices=("daemon", "local"), default="daemon", help="run alone on a fresh chain of daemons (default) or in process")
    parser.add_argument("--final-tokens", type=int, default=4, help="greedy tokens every session decodes at the end (default 4)")
    parser.add_argument("--sample-interval", type=float, default=0.1, help="seconds between stats samples of every daemon (default 0.1)")
    parser.add_argument("--uss-tolerance", default="48MiB", help="how far a worker's USS may end from its pre-run value, or from its own baseline if it was started during the run (default 48MiB: below the daemon's 64MiB recycle margin)")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write the raw figures (operations, latencies, errors, samples, verdicts) as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def options_from(args: argparse.Namespace) -> StressOptions:
    sockets = tuple(pathlib.Path(part) for part in args.sockets.split(",") if part) if args.sockets else ()
    return StressOptions(
        sessions=args.sessions, ops=args.ops, seed=args.seed, budget_for=args.budget_for, ttl_s=args.ttl,
        kill_worker=args.kill_worker, sockets=sockets, model=args.model, parts=args.parts, n_ctx=args.n_ctx,
        reference=args.reference, final_tokens=args.final_tokens, sample_interval_s=args.sample_interval,
        uss_tolerance_bytes=parse_bytes(args.uss_tolerance), json_path=args.json, progress=not args.quiet,
    )


def run(args: argparse.Namespace) -> int:
    """0: every verdict passed; 1: a verdict failed; 2: bad options or the run could not be set up."""
    try:
        options = options_from(args)
    except ValueError as error:
        print(f"kvpool stress: error: {error}", file=sys.stderr)
        return 2
    say: Say = _stderr_say if options.progress else (lambda message: None)
    try:
        report = run_stress(options, say=say)
    except (DaemonStartFailed, ShardError, BundledModelMissing, ConnectionLost, OSError) as error:
        print(f"kvpool stress: error: {error}", file=sys.stderr)
        return 2
    print(render(report))
    if options.json_path is not None:
        say(f"raw figures written to {options.json_path}")
    return 0 if report.passed else 1


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("kvpool stress: interrupted", file=sys.stderr)
        return 130

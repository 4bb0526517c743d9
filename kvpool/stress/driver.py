"""One session: its plan, its setup and the SessionDriver thread that runs it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import psutil

from kvpool.client import Client, ConnectionLost, KvpoolError
from kvpool.protocol import ErrorCode, MissReason
from kvpool.stress.log import LogEntry, LoggedAppend, LoggedReset, LoggedTruncate, row_digest
from kvpool.stress.options import FORCED_KINDS, IDLE_MARGIN_S, OpKind, StressOptions
from kvpool.stress.recording import Recorder
from kvpool.stress.report import KillRecord

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

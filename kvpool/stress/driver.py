"""One session: the SessionDriver thread that runs its plan through the route, as a router would."""

from __future__ import annotations

import contextlib
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.client import Client, ConnectionLost, KvpoolError
from kvpool.protocol import ErrorCode, MissReason
from kvpool.stress import probes
from kvpool.stress.cancels import CancelDrill, CancelResult
from kvpool.stress.errors import ContractViolation, StageFailed
from kvpool.stress.faults import FaultInjector
from kvpool.stress.log import LogEntry, LoggedAppend, LoggedReset, LoggedTruncate, row_digest
from kvpool.stress.options import OpKind, StressOptions
from kvpool.stress.plans import SessionSetup
from kvpool.stress.recording import Recorder
from kvpool.stress.restarts import ChainControl
from kvpool.stress.schedule import OpSchedule, target_name

PREFILL_CHUNKS = (1, 2, 3, 5, 8, 13, 16, 24)
JITTER_MAX_S = 0.003
ADMIT_RETRY_S = 120.0
MAX_REPLAYS_PER_RECOVERY = 200
MAX_CONNECTION_RECOVERIES = 5
# After an eviction a router backs off before replaying (random, doubling while it keeps being evicted):
# with more active sessions than the budget holds, immediate replays evict each other forever.
BACKOFF_BASE_S = 0.02
BACKOFF_MAX_DOUBLINGS = 5


class SessionDriver:
    """Runs one session's operations through the route; keeps what took effect in `log`.

    State invariant between operations: every daemon holds positions [0, length) of `tokens` for
    (session_id, epoch); `logits` is the last-row output for position length - 1 when known.
    """

    def __init__(self, setup: SessionSetup, clients: Sequence[Client], options: StressOptions, recorder: Recorder, control: ChainControl | None = None) -> None:
        self.setup = setup
        self.session_id = setup.session_id
        self.clients = list(clients)
        self.options = options
        self.recorder = recorder
        self.control = control
        self.rng = random.Random(f"session:{options.seed}:{setup.index}")
        self.epoch = 1
        self.tokens: list[int] = list(setup.prompt)
        self.length = 0
        self.logits: np.ndarray | None = None
        self.log: list[LogEntry] = []
        self.stage = -1  # the daemon the current append is at; read by the canceller thread
        self.first_error_at = 0.0  # monotonic time of the first error reply since it was set to 0 (the stall drill does)
        self.schedule = OpSchedule(setup.plan, self.rng, len(self.clients))
        self.op_index = 0
        self._op_label = ""
        self._generations = control.generations() if control is not None else []
        self.faults = FaultInjector(self)
        self.cancels = CancelDrill(self)
        self.ops: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.appends = self.resets = self.recoveries = self.connection_losses = 0
        self.cancels_landed = self.cancels_completed = self.late_cancels = self.cancel_attempts_missed = 0
        self.cancels_landed_on: Counter[int] = Counter()
        self.violations: list[str] = []
        self.failed_op = ""
        self.idle_results: list[str] = []
        self._evicted_in_a_row = 0

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            for self.op_index in range(self.options.ops):
                self._do(self.schedule.choose(self))
                time.sleep(self.rng.random() * JITTER_MAX_S)
            self._finish()
        except ContractViolation as violation:
            self._violated(str(violation))
        except ConnectionLost as error:
            self._violated(f"connection lost (did a daemon die?): {error}")
        except Exception:  # noqa: BLE001 - reported as a failure of this session, the run goes on
            self._violated(traceback.format_exc())
        finally:
            with contextlib.suppress(Exception):
                self._release_at_end()

    def _violated(self, message: str) -> None:
        self.violations.append(message)
        self.failed_op = self._op_label or "(between operations)"

    def _do(self, kind: OpKind) -> None:
        self._op_label = str(kind)
        with self.recorder.timed(kind):
            self._survive(lambda: self._perform(kind))
        self.ops[kind] += 1
        self.recorder.op_done()

    def _finish(self) -> None:
        """Run every forced operation still pending, complete any pending prefill and decode `final_tokens`
        more: the compared final logits."""
        self.op_index = sys.maxsize  # past every planned operation: pending forced ones and faults happen now
        target: int | None = None  # set once nothing forced is left (a forced release or truncate changes the tokens)
        for _ in range(MAX_REPLAYS_PER_RECOVERY):
            self._op_label = "closing"
            if self.length < len(self.tokens):
                with self.recorder.timed(OpKind.PREFILL):
                    self._survive(lambda: self._append(self.tokens[self.length :], greedy=False))
            elif self.logits is None:
                self._survive(lambda: self.recover(new_epoch=False, reason="no logits"))
            elif self.schedule.forced_pending:
                kind = self.schedule.next_forced(self)
                if kind is not None:
                    self._do(kind)
            elif len(self.tokens) < (target := target or len(self.tokens) + self.options.final_tokens):
                with self.recorder.timed(OpKind.DECODE):
                    self._survive(self._decode)
            else:
                return
        raise ContractViolation(f"{self.session_id}: could not finish after {MAX_REPLAYS_PER_RECOVERY} steps")

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
                self._cancel()
            case OpKind.RELEASE:
                self._release_all()
                self.reset()
                self.tokens = list(self.setup.prompt)
            case OpKind.EPOCH_BUMP:
                probes.bump_epoch(self)
            case OpKind.STALE:
                probes.stale_request(self)
            case OpKind.IDLE:
                probes.idle_until_expired(self)

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
                self.first_error_at = self.first_error_at or time.monotonic()
                self.recorder.error(error)
                # A router's answer to over_budget at admission (or, with the warm tier, at a restore): back off and ask again.
                admitting = start == 0 and self.options.budget_for is not None
                if error.code == ErrorCode.OVER_BUDGET and (admitting or self.options.spill) and time.monotonic() < deadline:
                    time.sleep(self.rng.uniform(0.005, 0.03))
                    continue
                raise StageFailed(stage, error) from None

    def route_append(self, start: int, tokens: Sequence[int], before_stage: Callable[[int], None] | None = None) -> np.ndarray:
        rows: np.ndarray | None = None
        try:
            for stage in range(len(self.clients)):
                self.stage = stage
                if before_stage is not None:
                    before_stage(stage)
                rows = self._stage_append(stage, start, tokens, rows)
        finally:
            self.stage = -1
        assert rows is not None
        return np.array(rows[-1], copy=True)

    def _append(self, tokens: Sequence[int], *, greedy: bool, before_stage: Callable[[int], None] | None = None) -> StageFailed | None:
        start = self.length
        try:
            last = self.route_append(start, tokens, before_stage)
        except StageFailed as failure:
            self.handle_failure(failure)
            return failure
        self.took_effect(start, tokens, last, greedy)
        self._evicted_in_a_row = 0  # progress beyond a replay
        return None

    def took_effect(self, start: int, tokens: Sequence[int], last: np.ndarray, greedy: bool) -> None:
        self.log.append(LoggedAppend(start, tuple(int(t) for t in tokens), row_digest(last), greedy))
        self.length = start + len(tokens)
        self.logits = last
        self.appends += 1

    def truncate_all(self, length: int, stages: Sequence[int] | None = None) -> bool:
        for stage in range(len(self.clients)) if stages is None else stages:
            try:
                kept = self.clients[stage].truncate(self.session_id, self.epoch, length)
            except KvpoolError as error:
                self.recorder.error(error)
                self.handle_failure(StageFailed(stage, error))
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

    def reset(self) -> None:
        self.log.append(LoggedReset())
        self.length = 0
        self.logits = None
        self.resets += 1

    # ---- failures and recovery (what a router does) -----------------------------------------------------

    def handle_failure(self, failure: StageFailed) -> None:
        error = failure.error
        if error.code == ErrorCode.CACHE_MISS and error.reason in (MissReason.EVICTED, MissReason.EXPIRED, MissReason.WORKER_LOST):
            self.misses[str(error.reason)] += 1
            self.recover(new_epoch=error.reason == MissReason.WORKER_LOST, reason=f"cache_miss/{error.reason}")
        elif error.code == ErrorCode.WORKER_LOST:
            self.misses["worker_lost"] += 1
            self.recover(new_epoch=True, reason="worker_lost")
        else:
            raise ContractViolation(
                f"{self.session_id} epoch {self.epoch}: daemon {failure.stage} answered {error} at length {self.length}"
            )

    def recover(self, *, new_epoch: bool, reason: str) -> None:
        """Release everywhere, take a new epoch if a worker was lost, and replay the tokens from 0."""
        self.recorder.event(f"recoveries ({reason})")
        evicted = reason.endswith(MissReason.EVICTED)
        for _ in range(MAX_REPLAYS_PER_RECOVERY):
            self.recoveries += 1
            self._release_all()
            if new_epoch:
                self.epoch += 1
            self.reset()
            if evicted:
                self._evicted_in_a_row += 1
                time.sleep(self.rng.uniform(0, BACKOFF_BASE_S * 2 ** min(self._evicted_in_a_row, BACKOFF_MAX_DOUBLINGS)))
            try:
                with self.recorder.timed("replay"):
                    last = self.route_append(0, self.tokens)
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
            self.took_effect(0, self.tokens, last, greedy=False)
            return
        raise ContractViolation(f"{self.session_id}: no progress after {MAX_REPLAYS_PER_RECOVERY} replays")

    def _survive(self, action: Callable[[], object]) -> None:
        """Run `action`; if a killed supervisor cut a connection, reconnect and replay from 0 at a new epoch."""
        for _ in range(MAX_CONNECTION_RECOVERIES):
            try:
                action()
                return
            except ConnectionLost as error:
                self._reconnect(error)
                self.connection_losses += 1
                self.recorder.event("connection lost (supervisor killed): replayed at a new epoch")
                action = lambda: self.recover(new_epoch=True, reason="connection lost")  # noqa: E731
        raise ContractViolation(f"{self.session_id}: still losing connections after {MAX_CONNECTION_RECOVERIES} recoveries")

    def _reconnect(self, error: ConnectionLost) -> None:
        """Wait until every daemon restarted since this session last looked serves again; new clients there.
        A lost connection no drill explains is a contract failure."""
        lost = self.control.stages_lost_since(self._generations) if self.control is not None else []
        if not lost:
            raise ContractViolation(f"connection lost (did a daemon die?): {error}")
        for stage in lost:
            self._generations[stage] = self.control.wait_serving(stage, self.session_id)
            old = self.clients[stage]
            old.close()
            self.clients[stage] = Client(old.socket_path, name=self.session_id)

    def _release_at_end(self) -> None:
        for _ in range(MAX_CONNECTION_RECOVERIES):
            try:
                self._release_all()
                return
            except ConnectionLost as error:
                self._reconnect(error)

    # ---- operations ---------------------------------------------------------------------------------------

    def _decode(self) -> None:
        assert self.logits is not None
        token = int(np.argmax(self.logits))
        failure = self._append([token], greedy=True, before_stage=self.faults.hook())
        if failure is None:
            self.tokens.append(token)
        self.faults.after_decode(failure)

    def _truncate(self) -> None:
        keep = self.rng.randrange(1, self.length)
        if not self.truncate_all(keep):
            return
        self.log.append(LoggedTruncate(keep))
        self.length = keep
        self.logits = None
        if self.rng.random() < 0.5:  # roll back generated tokens too: they will be generated again
            self.tokens = self.tokens[: max(keep + 1, len(self.setup.prompt))]

    def _cancel(self) -> None:
        target = self.schedule.cancel_target()
        self._op_label = target_name(target)
        result = CancelResult.INTERRUPTED
        try:
            result = self.cancels.run(target)
        finally:
            self.schedule.cancel_done(target, result, self.op_index)

    def unexercised(self) -> list[str]:
        return self.schedule.unexercised()

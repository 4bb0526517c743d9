"""One session: the SessionDriver thread that runs its plan through kvpool.router, as a router would.

Recovery is the router's (replay from 0 at a new epoch with the session's own partition; over_budget
retried after retry_after_s). The driver logs what the daemons were made to hold, for the run alone: a
replay inside an append as a reset and the session's appends again (kvpool.stress.log.replayed). Between
operations every daemon holds [0, length) of `tokens` under the session's epoch (or lost it to eviction or
expiry, and the next append replays); `logits` is the output for position length - 1 when known.
"""

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
from kvpool.route import StageFailed
from kvpool.router import RecoveryFailed, RecoveryPolicy, Router
from kvpool.stress import probes
from kvpool.stress.cancels import CancelDrill, CancelResult
from kvpool.stress.errors import ContractViolation
from kvpool.stress.faults import FaultInjector
from kvpool.stress.log import LogEntry, LoggedAppend, LoggedReset, LoggedTruncate, replayed, row_digest
from kvpool.stress.options import OpKind, StressOptions
from kvpool.stress.plans import SessionSetup
from kvpool.stress.recording import Recorder
from kvpool.stress.restarts import ChainControl
from kvpool.stress.schedule import OpSchedule, target_name
from kvpool.stress.tap import Reconnected, TappedClient

PREFILL_CHUNKS = (1, 2, 3, 5, 8, 13, 16, 24)
JITTER_MAX_S = 0.003
MAX_CLOSING_STEPS = 200
MAX_CONNECTION_RECOVERIES = 5
ADMIT_TIMEOUT_S = 60.0  # a session admitted on a full daemon waits in its line, first come first served
# Recovery is the router's; the stress only bounds it far above what a slow, busy machine needs.
POLICY = RecoveryPolicy(max_replays=200, over_budget_give_up_s=1800.0)
StageHook = Callable[[int, int, int], None]  # (stage, start_pos, rows) just before an append goes to a daemon


class SessionDriver:
    def __init__(self, setup: SessionSetup, clients: Sequence[Client], options: StressOptions, recorder: Recorder, control: ChainControl | None = None) -> None:
        self.setup = setup
        self.session_id = setup.session_id
        self.options = options
        self.recorder = recorder
        self.control = control
        self.rng = random.Random(f"session:{options.seed}:{setup.index}")
        self.clients = [TappedClient(stage, client, self) for stage, client in enumerate(clients)]
        self.router = Router(self.clients, policy=POLICY, seed=options.seed)
        self.session = self.router.session(setup.session_id, n_ctx=options.n_ctx, admit_timeout_s=ADMIT_TIMEOUT_S)
        self.tokens: list[int] = list(setup.prompt)
        self.logits: np.ndarray | None = None
        self.log: list[LogEntry] = []
        self.stage = -1  # the daemon an append is at right now; read by the canceller thread
        self.stage_hook: StageHook | None = None  # set by the operation that aims at a daemon (fault, cancel)
        self.cancelled_reply: tuple[int, int] | None = None  # (stage, length) of the last cancelled reply
        self.schedule = OpSchedule(setup.plan, self.rng, len(self.clients))
        self.op_index = 0
        self._op_label = ""
        self._generations = control.generations() if control is not None else []
        self.faults = FaultInjector(self)
        self.cancels = CancelDrill(self)
        self.ops: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.appends = self.resets = self.connection_losses = self.restarts = 0
        self._unanswered_losses = 0  # reconnections the router has not answered with a replay at a new epoch
        self.cancels_landed = self.cancels_completed = self.late_cancels = self.cancel_attempts_missed = 0
        self.cancels_landed_on: Counter[int] = Counter()
        self.admission_waits: list[float] = []  # seconds each admission took, queue and back-off included
        self.finished_at: float | None = None  # monotonic time the session's last operation completed
        self.final_length = 0  # the session's length when it ended (before its release)
        self.violations: list[str] = []
        self.failed_op = ""
        self.idle_results: list[str] = []

    @property
    def epoch(self) -> int:
        return self.session.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.session.epoch = value

    @property
    def length(self) -> int:
        return self.session.length

    @property
    def recoveries(self) -> int:
        """Replays the router started, and restarts after a connection lost outside the router."""
        counts = self.session.counts
        return counts.cache_misses + counts.workers_lost + counts.connections_lost + self.restarts

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            for self.op_index in range(self.options.ops):
                self._do(self.schedule.choose(self))
                time.sleep(self.rng.random() * JITTER_MAX_S)
            self._finish()
            self.finished_at = time.monotonic()
        except ContractViolation as violation:
            self._violated(str(violation))
        except (StageFailed, RecoveryFailed) as failure:
            self._violated(f"{self.session_id} epoch {self.epoch}: {failure} (at length {self.length})")
        except ConnectionLost as error:
            self._violated(f"connection lost (did a daemon die?): {error}")
        except Exception:  # noqa: BLE001 - reported as a failure of this session, the run goes on
            self._violated(traceback.format_exc())
        finally:
            self.final_length = self.length
            with contextlib.suppress(Exception):
                self._release_all()

    def _violated(self, message: str) -> None:
        self.violations.append(message)
        self.failed_op = self._op_label or "(between operations)"

    def _do(self, kind: OpKind) -> None:
        self._op_label = str(kind)
        with self.recorder.timed(kind):
            self._survive(lambda: self._perform(kind))
        if self.session.needs_replay and self.length:  # a failed truncate or roll-back: start again from 0
            self.start_over()
        self.ops[kind] += 1
        self.recorder.op_done()

    def _finish(self) -> None:
        """Run every forced operation still pending, complete any pending prefill and decode `final_tokens`
        more: the compared final logits."""
        self.op_index = sys.maxsize  # past every planned operation: pending forced ones and faults happen now
        target: int | None = None  # set once nothing forced is left (a forced release or truncate changes the tokens)
        for _ in range(MAX_CLOSING_STEPS):
            self._op_label = "closing"
            if self.length < len(self.tokens):
                with self.recorder.timed(OpKind.PREFILL):
                    self._survive(lambda: self.append(self.tokens[self.length :], greedy=False))
            elif self.logits is None:
                self._survive(self.start_over)
            elif self.schedule.forced_pending:
                kind = self.schedule.next_forced(self)
                if kind is not None:
                    self._do(kind)
            elif len(self.tokens) < (target := target or len(self.tokens) + self.options.final_tokens):
                with self.recorder.timed(OpKind.DECODE):
                    self._survive(self._decode)
            else:
                return
        raise ContractViolation(f"{self.session_id}: could not finish after {MAX_CLOSING_STEPS} steps")

    def _perform(self, kind: OpKind) -> None:
        match kind:
            case OpKind.PREFILL:
                chunk = min(len(self.tokens) - self.length, self.rng.choice(PREFILL_CHUNKS))
                self.append(self.tokens[self.length : self.length + chunk], greedy=False)
            case OpKind.DECODE:
                self._decode()
            case OpKind.TRUNCATE:
                self._truncate()
            case OpKind.CANCEL:
                self._cancel()
            case OpKind.RELEASE:
                self.start_over()
                self.tokens = list(self.setup.prompt)
            case OpKind.EPOCH_BUMP:
                probes.bump_epoch(self)
            case OpKind.STALE:
                probes.stale_request(self)
            case OpKind.IDLE:
                probes.idle_until_expired(self)

    # ---- through the router ------------------------------------------------------------------------------

    def route_append(self, tokens: Sequence[int]) -> np.ndarray:
        """The router's append of `tokens` at the session's length: the last output row. A replay the router
        did first is logged here; the append itself is the caller's to log (took_effect)."""
        counts = self.session.counts
        before, partition, replays, lost = self.session.tokens, self.session.partition, counts.replays, counts.connections_lost
        try:
            rows = self.session.append(list(tokens))
        finally:
            if counts.replays != replays:
                self.log += replayed(before, partition)
                self.resets += 1
            if counts.connections_lost != lost:
                self._unanswered_losses = 0  # the router replayed at a new epoch
        return np.array(rows[-1], copy=True)

    def append(self, tokens: Sequence[int], *, greedy: bool) -> None:
        start = self.length
        self.took_effect(start, tokens, self.route_append(tokens), greedy)

    def took_effect(self, start: int, tokens: Sequence[int], last: np.ndarray, greedy: bool) -> None:
        self.log.append(LoggedAppend(start, tuple(int(t) for t in tokens), row_digest(last), greedy))
        self.logits = last
        self.appends += 1

    def truncate_to(self, length: int) -> None:
        self.session.truncate(length)
        self.log.append(LoggedTruncate(length))

    def start_over(self) -> None:
        """Release the session everywhere (at the router session's epoch); the next append starts from 0."""
        self._release_all()
        self.log.append(LoggedReset())
        self.logits = None
        self.resets += 1

    def _release_all(self) -> None:
        for _ in range(MAX_CONNECTION_RECOVERIES):
            try:
                self.session.release()
                return
            except ConnectionLost:
                continue  # the tap reconnected to a restarted daemon: release again
        raise ContractViolation(f"{self.session_id}: still losing connections after {MAX_CONNECTION_RECOVERIES} releases")

    # ---- the tap: each request to a daemon (kvpool.stress.tap) ---------------------------------------------

    def sending(self, stage: int, start_pos: int, rows: int) -> None:
        self.stage = stage
        if self.stage_hook is not None:
            self.stage_hook(stage, start_pos, rows)

    def answered(self, stage: int, error: KvpoolError | None, *, admitted: bool = False, waited_s: float = 0.0) -> None:
        self.stage = -1
        if admitted:
            self.admission_waits.append(waited_s)
        if error is not None:
            self.recorder.error(error)
            if error.code == ErrorCode.CACHE_MISS and error.reason in (MissReason.EVICTED, MissReason.EXPIRED, MissReason.WORKER_LOST):
                self.misses[str(error.reason)] += 1
            elif error.code == ErrorCode.WORKER_LOST:
                self.misses["worker_lost"] += 1
            elif error.code == ErrorCode.CANCELLED:
                self.cancelled_reply = (stage, error.length)
        self.faults.answered(stage, error)

    def lost(self, _stage: int, error: ConnectionLost) -> None:
        """Only a killed supervisor (the drill) explains a lost connection: reconnect to every daemon
        restarted since this session last looked (kvpool.stress.restarts), or fail the run."""
        self.stage = -1
        if self.control is None or not self.control.reconnect(self._generations, self.clients, self.session_id):
            raise ContractViolation(f"connection lost (did a daemon die?): {error}")
        self.connection_losses += 1
        self._unanswered_losses += 1
        self.recorder.event("connection lost (supervisor killed): replayed at a new epoch")

    def _survive(self, action: Callable[[], object]) -> None:
        """Run `action`. A connection lost where the router did not replay (a truncate, a release, a probe's
        or a drill's own request) is answered here as the router would: start again from 0 at a new epoch."""
        for _ in range(MAX_CONNECTION_RECOVERIES):
            try:
                action()
            except ConnectionLost as error:
                if not isinstance(error, Reconnected):
                    self.lost(-1, error)
            if not self._unanswered_losses:
                return
            self._unanswered_losses = 0
            self.restarts += 1
            self.epoch += 1
            action = self.start_over
        raise ContractViolation(f"{self.session_id}: still losing connections after {MAX_CONNECTION_RECOVERIES} recoveries")

    # ---- operations ---------------------------------------------------------------------------------------

    def _decode(self) -> None:
        assert self.logits is not None
        token = int(np.argmax(self.logits))
        self.stage_hook = self.faults.hook()
        try:
            self.append([token], greedy=True)
        finally:
            self.stage_hook = None
        self.tokens.append(token)

    def _truncate(self) -> None:
        keep = self.rng.randrange(1, self.length)
        self.truncate_to(keep)
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

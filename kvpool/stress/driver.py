"""One session: the SessionDriver thread that runs its plan, operation by operation, through its
TappedSession (kvpool.stress.tapped_session), as a router would, then finishes it: forced operations
still pending, the prompt completed, the final tokens decoded.

Between operations every daemon holds [0, length) of `tokens` under the session's epoch (or lost it to
eviction or expiry, and the next append replays).
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence

import numpy as np

from kvpool.client.client import Client, ConnectionLost
from kvpool.router.route import StageFailed
from kvpool.router.router import RecoveryFailed
from kvpool.stress import probes
from kvpool.stress.cancels import CancelDrill, CancelResult
from kvpool.stress.errors import ContractViolation
from kvpool.stress.faults import FaultInjector
from kvpool.stress.options import OpKind, StressOptions
from kvpool.stress.plans import SessionSetup
from kvpool.stress.prefixes import prefill_rows
from kvpool.stress.recording import Recorder
from kvpool.stress.restarts import ChainControl
from kvpool.stress.schedule import OpSchedule, target_name
from kvpool.stress.tapped_session import TappedSession

PREFILL_CHUNKS = (1, 2, 3, 5, 8, 13, 16, 24)
JITTER_MAX_S = 0.003
MAX_CLOSING_STEPS = 200
FOLLOW_HANG_GUARD_S = 600.0  # --shared-prefix: the longest a session waits for the first append of the one it follows


class SessionDriver(TappedSession):
    """The plan of one session run as a thread (`run`): its operations, seeded, then its closing steps. It is
    the SessionState (kvpool.stress.state) its drills and its schedule take."""

    def __init__(self, setup: SessionSetup, clients: Sequence[Client], options: StressOptions, recorder: Recorder, control: ChainControl | None = None) -> None:
        super().__init__(setup, clients, options, recorder, control)
        self.rng = random.Random(f"session:{options.seed}:{setup.index}")
        self.tokens: list[int] = list(setup.prompt)
        self.schedule = OpSchedule(setup.plan, self.rng, len(self.clients))
        self.op_index = 0
        self._op_label = ""
        self.faults = FaultInjector(self)
        self.cancels = CancelDrill(self)
        self.ops: Counter[str] = Counter()
        self.cancels_landed = self.cancels_completed = self.late_cancels = self.cancel_attempts_missed = 0
        self.cancels_landed_on: Counter[int] = Counter()
        self.finished_at: float | None = None  # monotonic time the session's last operation completed
        self.final_length = 0  # the session's length when it ended (before its release)
        self.violations: list[str] = []
        self.failed_op = ""
        self.idle_results: list[str] = []
        self.follows: SessionDriver | None = None  # --shared-prefix: starts after that session's first append

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            if self.follows is not None:  # a hang guard only: it starts anyway, and its first start may then miss
                self.follows.first_start.wait(FOLLOW_HANG_GUARD_S)
            for self.op_index in range(self.options.ops):
                if self._replan_due():
                    self._replan()
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
            self.first_start.set()  # a session following this one never waits for a start that will not come
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
                    self._survive(lambda: self.append(self.tokens[self.length : self._closing_end()], greedy=False))
            elif self.logits is None:
                self._survive(self.start_over)
            elif self._replan_due():
                self._replan()
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
                self.append(self.tokens[self.length : self.length + self._prefill_rows()], greedy=False)
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

    # ---- operations ---------------------------------------------------------------------------------------

    def _prefill_rows(self) -> int:
        pending = len(self.tokens) - self.length
        if self.options.shared_prefix:  # the prompt first, then chunks of two rows or more (kvpool.stress.prefixes)
            return prefill_rows(self.length, pending, len(self.setup.prompt), self.rng)
        return min(pending, self.rng.choice(PREFILL_CHUNKS))

    def _closing_end(self) -> int:
        """Where the closing prefill ends: every pending token, or with --shared-prefix a fresh session's prompt first."""
        return len(self.setup.prompt) if self.options.shared_prefix and self.length == 0 else len(self.tokens)

    def _replan_due(self) -> bool:
        """A planned re-plan is due and the session holds tokens to move (else it waits for a later operation)."""
        return self.replans is not None and self.replans.due(self.op_index) and self.length > 0

    def _replan(self) -> None:
        self._op_label = "replan"
        with self.recorder.timed("replan"):
            record = self.replan()
        self.recorder.event(f"replan {record.outcome}")

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

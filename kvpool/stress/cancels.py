"""The cancel drills of one session, each aimed so that it does not depend on the machine's speed.

- Mid-prefill on daemon k: a long prefill goes down the route (kvpool.router.router); a canceller thread waits
  until the append is at daemon k and then sends `cancel` there again and again (a few ms apart) until
  the append leaves daemon k. The prefill of the filler takes far longer on any machine than a cancel's
  round trip, so the cancel lands; if the append still completes first (or a cancel answered "cancel
  requested" just as the compute finished), the prefill is rolled back and tried again, up to
  CANCEL_ATTEMPTS times, and only then reported as not exercised (a warning, never a failure).
  Checked: the cancelled reply comes from daemon k only, with the length before the append; every
  cancel answer is one the contract allows at that moment. The router truncates the daemons before k
  back to that length.
- Late: the long prefill completes, then `cancel` goes to every daemon: each must answer "nothing in
  flight" with the length after the append. No timing is involved.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvpool.client.client import ConnectionLost, KvpoolError
from kvpool.router.router import Cancelled
from kvpool.stress.errors import ContractViolation
from kvpool.stress.options import LATE_CANCEL
from kvpool.stress.state import SessionState

CANCEL_ATTEMPTS = 3  # long prefills per mid-prefill target before it is reported as not exercised
CANCEL_POLL_S = 0.002  # between two cancels sent while the append is at the target daemon
REACH_POLL_S = 0.05


class CancelResult(enum.Enum):
    EXERCISED = "exercised"  # landed where aimed, or (late) answered correctly by every daemon
    MISSED = "missed"  # every attempt completed before a cancel landed (timing): reported, not failed
    INTERRUPTED = "interrupted"  # the session's state was lost meanwhile (eviction, expiry, lost worker): plan again


@dataclasses.dataclass(slots=True)
class CancelProbe:
    """What the canceller thread saw during one attempt at daemon `stage`."""

    stage: int
    start: int
    rows: int
    reached: threading.Event = dataclasses.field(default_factory=threading.Event)  # the append is at `stage`
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)  # the append returned
    sent: int = 0
    requested: int = 0  # answers "cancel requested"
    problems: list[str] = dataclasses.field(default_factory=list)


class CancelDrill:
    def __init__(self, state: SessionState) -> None:
        self.state = state

    def run(self, target: int) -> CancelResult:
        return self._late() if target == LATE_CANCEL else self._mid_prefill(target)

    def _filler(self) -> tuple[int, ...]:
        d = self.state
        return d.setup.filler[: min(len(d.setup.filler), d.options.n_ctx - d.length - 1)]

    # ---- mid-prefill on one daemon -------------------------------------------------------------------------

    def _mid_prefill(self, stage: int) -> CancelResult:
        d = self.state
        start, filler = d.length, self._filler()
        for _attempt in range(CANCEL_ATTEMPTS):
            probe = CancelProbe(stage, start, len(filler))
            canceller = threading.Thread(target=self._cancel_while_at, args=(probe,), name=f"{d.session_id}-cancel", daemon=True)
            canceller.start()

            def reached(at: int, start_pos: int, _rows: int) -> None:
                if at == stage and start_pos == start:  # the long prefill itself, not a replay before it
                    probe.reached.set()

            d.cancelled_reply = None
            d.stage_hook = reached
            try:
                last = d.route_append(filler)
            except Cancelled as cancelled:
                self._end(probe, canceller)
                return self._cancelled(probe, cancelled)
            except BaseException:
                self._end(probe, canceller)
                raise
            finally:
                d.stage_hook = None
            self._end(probe, canceller)
            d.cancel_attempts_missed += 1
            d.recorder.event(f"cancel attempts completed first (daemon {stage}; retried)")
            if not self._roll_back(start, filler, last):
                return CancelResult.INTERRUPTED
        return CancelResult.MISSED

    def _end(self, probe: CancelProbe, canceller: threading.Thread) -> None:
        probe.finished.set()
        canceller.join()
        if probe.problems:
            raise ContractViolation(f"{self.state.session_id}: " + "; ".join(probe.problems))

    def _cancelled(self, probe: CancelProbe, cancelled: Cancelled) -> CancelResult:
        """The router raised Cancelled: a daemon answered cancelled, and the router truncated the daemons
        before it back (or, if it could not, replays from 0 on the next append)."""
        d = self.state
        stage, length = d.cancelled_reply if d.cancelled_reply is not None else (cancelled.stage, -1)
        if stage != probe.stage or cancelled.stage != probe.stage:
            raise ContractViolation(f"{d.session_id}: daemon {stage} answered cancelled, but cancels went to daemon {probe.stage} only")
        if not probe.sent:
            raise ContractViolation(f"{d.session_id}: daemon {stage} answered cancelled before any cancel was sent")
        if length != probe.start:
            raise ContractViolation(f"{d.session_id}: cancelled append answered length {length}, expected {probe.start}")
        d.cancels_landed += 1
        d.cancels_landed_on[probe.stage] += 1
        d.recorder.event(f"cancel landed on daemon {probe.stage}")
        return CancelResult.EXERCISED

    def _cancel_while_at(self, probe: CancelProbe) -> None:
        """The canceller thread: cancel at `probe.stage` for as long as the append is there."""
        d = self.state
        while not probe.reached.wait(REACH_POLL_S):
            if probe.finished.is_set():
                return
        client, epoch = d.clients[probe.stage], d.epoch
        while not probe.finished.is_set() and d.stage == probe.stage:
            try:
                done = client.cancel(d.session_id, epoch)
            except KvpoolError as error:
                probe.problems.append(f"cancel on daemon {probe.stage} answered {error}")
                return
            except ConnectionLost:
                return  # a killed supervisor: the append fails the same way and the driver recovers
            probe.sent += 1
            if done.detail == "cancel requested":
                probe.requested += 1
            elif done.detail == "nothing in flight":  # the append is not there yet, or done there
                if done.length not in (probe.start, probe.start + probe.rows):
                    probe.problems.append(f"cancel on daemon {probe.stage} answered nothing in flight at length {done.length} (expected {probe.start} or {probe.start + probe.rows})")
                    return
            elif done.detail == "no state" and d.options.may_lose_state:
                return  # evicted or expired there meanwhile: the append misses and the session recovers
            else:
                probe.problems.append(f"cancel on daemon {probe.stage} answered {done.detail!r}, length {done.length}")
                return
            time.sleep(CANCEL_POLL_S)

    # ---- late: after the append completed ------------------------------------------------------------------

    def _late(self) -> CancelResult:
        d = self.state
        start, filler = d.length, self._filler()
        try:
            last = d.route_append(filler)
        except Cancelled as cancelled:
            raise ContractViolation(f"{d.session_id}: daemon {cancelled.stage} answered cancelled though no cancel was sent") from None
        expected = start + len(filler)
        answers = []
        for stage, client in enumerate(d.clients):
            try:
                done = client.cancel(d.session_id, d.epoch)
            except KvpoolError as error:
                raise ContractViolation(f"{d.session_id}: a cancel after completion on daemon {stage} answered {error}") from None
            allowed = {("nothing in flight", expected)} | ({("no state", 0)} if d.options.may_lose_state else set())
            if (done.detail, done.length) not in allowed:
                raise ContractViolation(f"{d.session_id}: a cancel after completion on daemon {stage} answered {done.detail!r}, length {done.length} (expected nothing in flight, {expected})")
            answers.append(done.detail)
        self._roll_back(start, filler, last)
        if "nothing in flight" not in answers:  # the state was gone everywhere (evicted, expired): nothing checked
            return CancelResult.INTERRUPTED
        d.late_cancels += 1
        d.recorder.event("cancel after completion (every daemon: nothing in flight)")
        return CancelResult.EXERCISED

    def _roll_back(self, start: int, filler: Sequence[int], last: np.ndarray) -> bool:
        """The long prefill completed: log it, then truncate it away (positions [0, start) and their
        logits are as before). False when the daemons could not all be truncated (the router replays)."""
        d = self.state
        d.cancels_completed += 1
        logits_before = d.logits
        d.took_effect(start, filler, last, greedy=False)
        d.truncate_to(start)
        d.logits = logits_before
        return not d.session.needs_replay

"""Faults one session injects at a planned decode, just before that decode's request reaches daemon k:

- kill_worker: SIGKILL the worker serving the session there; the request must get worker_lost (or a
  later one cache_miss/worker_lost), the session replays from 0 at a new epoch.
- stall_worker: SIGSTOP that worker, then send the request. The daemon (started with a short
  --request-timeout) must answer worker_lost once the timeout passes, kill the stopped worker and
  replace it. Should it never answer, the driver sends SIGCONT after the timeout plus STALL_GRACE_S, so
  the run ends (and fails) rather than hangs.
- kill_supervisor: SIGKILL daemon k's supervisor (kvpool.stress.restarts); the request then fails with
  ConnectionLost, and the session recovers like every other session of the route. With --persist-after the
  session first waits idle until daemon k has written its copy behind, and the kill comes TAIL_TOKENS
  decodes later: the restarted daemon adopts the copy, and the router replays only those tokens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import psutil

from kvpool.client.client import KvpoolError
from kvpool.stress.errors import ContractViolation
from kvpool.stress.options import FaultKind
from kvpool.stress.processes import stopped
from kvpool.stress.report import KillRecord, SavedState, StallRecord, SupervisorKillRecord
from kvpool.stress.restarts import copies_in
from kvpool.stress.state import SessionState
from kvpool.wire.protocol import SessionRow

STALL_GRACE_S = 30.0
DEAD_WAIT_S = 10.0
TAIL_TOKENS = 2  # --persist-after: decodes after the killed session's copy was written, so a tail is replayed
COPY_HANG_GUARD_S = 120.0  # past --persist-after, waiting for that copy
COPY_POLL_S = 0.05


def describe(error: KvpoolError | None) -> str:
    if error is None:
        return "append succeeded"
    return f"{error.code}/{error.reason}" if error.reason else str(error.code)


def wait_dead(pid: int, timeout_s: float = DEAD_WAIT_S) -> bool:
    """Until the process is gone or a zombie (its pipes are closed either way); False if it is not by then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.002)
    return False


class FaultInjector:
    def __init__(self, state: SessionState) -> None:
        self.state = state
        self.pending = list(state.setup.plan.faults)
        self.kill: KillRecord | None = None
        self.stall: StallRecord | None = None
        self.supervisor_kill: SupervisorKillRecord | None = None
        self._stalled_at = 0.0
        self._copy_wait_s = 0.0  # --persist-after: how long the killed session waited idle for its copy
        self._timer: threading.Timer | None = None
        self._awaiting: int | None = None  # the daemon whose next reply answers the injected fault

    def hook(self) -> Callable[[int, int, int], None] | None:
        """The hook run before each append of this decode reaches a daemon (kvpool.stress.tap), if a fault is due."""
        due = any(self.state.op_index >= fault.from_op for fault in self.pending)
        return self._before_stage if due else None

    def _before_stage(self, stage: int, _start_pos: int, _rows: int) -> None:
        for fault in list(self.pending):
            if fault.stage != stage or self.state.op_index < fault.from_op:
                continue
            match fault.kind:
                case FaultKind.KILL_WORKER:
                    done = self._kill_worker(stage)
                case FaultKind.STALL_WORKER:
                    done = self._stall_worker(stage)
                case FaultKind.KILL_SUPERVISOR:
                    done = self._kill_supervisor(stage)
            if done:
                self.pending.remove(fault)
                if fault.kind is not FaultKind.KILL_SUPERVISOR:
                    self._awaiting = stage

    def _session_row(self, stage: int) -> SessionRow | None:
        d = self.state
        rows = d.clients[stage].stats().sessions
        return next((r for r in rows if r.session_id == d.session_id and r.epoch == d.epoch), None)

    def _kill_worker(self, stage: int) -> bool:
        d = self.state
        row = self._session_row(stage)
        if row is None:
            return False  # not live there right now (evicted): try again on a later decode
        self.kill = KillRecord(session_id=d.session_id, daemon=stage, pid=row.worker_pid, epoch=d.epoch, length=d.length)
        os.kill(row.worker_pid, signal.SIGKILL)
        wait_dead(row.worker_pid)
        d.recorder.event("workers_killed")
        return True

    def _stall_worker(self, stage: int) -> bool:
        d = self.state
        row = self._session_row(stage)
        if row is None:
            return False
        self.stall = StallRecord(session_id=d.session_id, daemon=stage, pid=row.worker_pid, epoch=d.epoch, length=d.length, timeout_s=d.options.stall_timeout_s)
        os.kill(row.worker_pid, signal.SIGSTOP)
        self._stalled_at = time.monotonic()
        self._timer = threading.Timer(d.options.stall_timeout_s + STALL_GRACE_S, self._continue_stalled)
        self._timer.daemon = True
        self._timer.start()
        d.recorder.event("workers_stalled (SIGSTOP)")
        return True

    def _continue_stalled(self) -> None:
        record = self.stall
        if record is not None and stopped(record.pid):
            record.continued_by_driver = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGCONT)

    def _kill_supervisor(self, stage: int) -> bool:
        d = self.state
        assert d.control is not None, "--kill-supervisor needs the chain's control"
        copy = self._copy_behind(stage) if d.options.persist_after_s is not None else None
        if d.options.persist_after_s is not None and (copy is None or d.length < copy.length + TAIL_TOKENS):
            return False  # the copy is too recent: a later decode kills, so that a tail is left to replay
        self.supervisor_kill = d.control.kill_supervisor(stage, d.session_id, min(d.op_index, d.options.ops))
        self.supervisor_kill.victim_copy, self.supervisor_kill.copy_wait_s = copy, self._copy_wait_s
        d.recorder.event("supervisors_killed")
        return True

    def _copy_behind(self, stage: int) -> SavedState | None:
        """--persist-after: this session's copy on daemon `stage`'s disk tier (under its epoch, at most its
        length). Without one, the session stays idle there until the daemon writes one at its length (a hang
        guard only: the daemon writes it once the session is idle --persist-after seconds); None then."""
        d = self.state
        assert d.control is not None and d.options.persist_after_s is not None
        spill_dir = d.control.spill_dir(stage)
        length = copies_in(spill_dir).get((d.session_id, d.epoch), -1)
        if 0 < length <= d.length:
            return SavedState(d.session_id, d.epoch, length)
        began = time.monotonic()
        deadline = began + d.options.persist_after_s + COPY_HANG_GUARD_S
        while copies_in(spill_dir).get((d.session_id, d.epoch)) != d.length:
            if time.monotonic() > deadline:
                raise ContractViolation(f"{d.session_id}: idle {time.monotonic() - began:.0f} s on daemon {stage} (--persist-after {d.options.persist_after_s:g}) "
                                        f"and no copy of its {d.length} positions was written behind")
            time.sleep(COPY_POLL_S)
        self._copy_wait_s = round(time.monotonic() - began, 3)
        return None

    def answered(self, stage: int, error: KvpoolError | None) -> None:
        """Daemon `stage` answered a request: the first answer after a fault injected there is its reply."""
        if self._awaiting != stage:
            return
        self._awaiting = None
        answered_at = time.monotonic()
        if self.kill is not None and not self.kill.reply:
            self.kill.reply = describe(error)
        if self.stall is not None and not self.stall.reply:
            record = self.stall
            record.reply = describe(error)
            record.elapsed_s = round(answered_at - self._stalled_at, 3)
            if self._timer is not None:
                self._timer.cancel()
            record.worker_gone = wait_dead(record.pid)


def resume_stalled(records: list[StallRecord]) -> None:
    """At the end of the run: nothing may be left stopped (SIGCONT, and say so in the record)."""
    for record in records:
        if stopped(record.pid):
            record.left_stopped = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGCONT)

"""Faults one session injects at a planned decode, just before that decode's request reaches daemon k:

- kill_worker: SIGKILL the worker serving the session there; the request must get worker_lost (or a
  later one cache_miss/worker_lost), the session replays from 0 at a new epoch.
- stall_worker: SIGSTOP that worker, then send the request. The daemon (started with a short
  --request-timeout) must answer worker_lost once the timeout passes, kill the stopped worker and
  replace it. Should it never answer, the driver sends SIGCONT after the timeout plus STALL_GRACE_S, so
  the run ends (and fails) rather than hangs.
- kill_supervisor: SIGKILL daemon k's supervisor (kvpool.stress.restarts); the request then fails with
  ConnectionLost, and the session recovers like every other session of the route.
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
from kvpool.wire.protocol import SessionRow
from kvpool.stress.options import FaultKind
from kvpool.stress.processes import stopped
from kvpool.stress.report import KillRecord, StallRecord, SupervisorKillRecord
from kvpool.stress.state import SessionState

STALL_GRACE_S = 30.0
DEAD_WAIT_S = 10.0


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
        self.supervisor_kill = d.control.kill_supervisor(stage, d.session_id, min(d.op_index, d.options.ops))
        d.recorder.event("supervisors_killed")
        return True

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

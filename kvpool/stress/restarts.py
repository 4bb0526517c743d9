"""--kill-supervisor and --restart: stop a daemon of the route mid-run, check that nothing of it survives,
start its successor on the same socket (and spill dir).

Shared by the session threads. --kill-supervisor: the session that carries the fault SIGKILLs the
supervisor (the generation of that daemon goes up first, so any ConnectionLost after it is explained);
whichever session first needs the daemon again restarts it on the same socket path (`kvpool serve` replaces
a socket file nothing answers on); the others wait for that restart and reconnect. What they replay is the
router's rule (kvpool.router.session): the restarted daemon holds nothing (a full replay at a new epoch), or
with --persist-after the copy written behind (only the tail since). --restart: a RollingRestart thread drains
each daemon in turn (SIGTERM) and starts its successor, which adopts every parked session; the clients wait
for it (kvpool.client.successor), and the next append is answered restored: true, with nothing replayed.
"""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpool.client.client import Client
from kvpool.daemon.books.spill import OWN_FILE
from kvpool.launcher import Daemon, DaemonStartFailed
from kvpool.state.header import StateRejected, read_header
from kvpool.stress.daemons import Chain
from kvpool.stress.processes import existing, kill_all, mapped_segments, process_tree, unlink_all, wait_gone
from kvpool.stress.recording import Recorder
from kvpool.stress.report import RestartRecord, SavedState, SupervisorKillRecord

if TYPE_CHECKING:
    from kvpool.stress.tap import TappedClient

DRAIN_HANG_GUARD_S = 900.0  # a drain's SIGTERM to exit: above the daemons' --drain-timeout (options.DRAIN_TIMEOUT_S)
RESTART_POLL_S = 0.05


class ChainControl:
    def __init__(self, chain: Chain, say: Callable[[str], None]) -> None:
        self._chain = chain
        self._say = say
        self._lock = threading.Lock()
        self._generations = [0] * len(chain.sockets)
        self._records: dict[int, SupervisorKillRecord] = {}
        self.kills: list[SupervisorKillRecord] = []
        self.restarts: list[RestartRecord] = []  # --restart: each drain and its successor

    def generations(self) -> list[int]:
        with self._lock:
            return list(self._generations)

    def stages_lost_since(self, seen: Sequence[int]) -> list[int]:
        """Daemons whose supervisor was killed since a session recorded `seen`."""
        with self._lock:
            return [stage for stage, generation in enumerate(self._generations) if generation > seen[stage]]

    def reconnect(self, seen: list[int], taps: Sequence[TappedClient], name: str) -> bool:
        """After a lost connection: wait until every daemon restarted since `seen` serves again (updating
        `seen`) and give its tap a new client. False when none was restarted (nothing explains the loss)."""
        lost = self.stages_lost_since(seen)
        for stage in lost:
            seen[stage] = self.wait_serving(stage, name)
            tap = taps[stage]
            tap.client.close()
            tap.client = Client(tap.socket_path, name=name)
        return bool(lost)

    def restarted(self, stage: int) -> bool:
        with self._lock:
            return self._generations[stage] > 0

    def kill_supervisor(self, stage: int, session_id: str, op_index: int) -> SupervisorKillRecord:
        """SIGKILL daemon `stage`'s supervisor; then wait until its processes are gone (how long it took is
        recorded; the limit is a hang guard) and check that its segments went with them."""
        with self._lock:
            daemon = self._chain.daemons[stage]
            tree = process_tree(daemon.process.pid)
            descendants = tree[1:]
            record = SupervisorKillRecord(
                daemon=stage, pid=daemon.process.pid, session_id=session_id, op_index=op_index,
                descendants=[p.pid for p in descendants], segments=sorted(mapped_segments(tree)),
            )
            self._generations[stage] += 1
            self._records[stage] = record
            os.kill(daemon.process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            daemon.process.wait()
        self.kills.append(record)
        self._say(f"{session_id}: SIGKILL supervisor pid {record.pid} of daemon {stage} ({len(descendants)} processes under it, {len(record.segments)} segments)")
        gone = wait_gone(descendants, f"the processes of daemon {stage}'s killed supervisor", self._say, since=killed_at)
        record.orphans_at_deadline = [p.pid for p in gone.left_alive]
        if not gone.left_alive:
            record.all_gone_s = gone.seconds
        kill_all(gone.left_alive)
        # Whatever unlinks a dead supervisor's segments (multiprocessing's resource tracker, one of the
        # descendants) has run by the time they are all gone: a segment still there now stays.
        record.segments_left = existing(record.segments)
        unlink_all(record.segments_left)
        return record

    def wait_serving(self, stage: int, session_id: str) -> int:
        """Until daemon `stage` serves (restarting it if its supervisor is dead); its generation then."""
        with self._lock:
            daemon = self._chain.daemons[stage]
            if daemon.process.poll() is not None:
                self._restart(stage, daemon, session_id)
            return self._generations[stage]

    def _restart(self, stage: int, dead: Daemon, session_id: str) -> None:
        record = self._records[stage]
        if record.restart_error:
            raise DaemonStartFailed(record.restart_error)
        dead.stop()  # already reaped: closes its log and its lifeline
        self._start_successor(stage, dead, record, "killed")
        record.restarted_by = session_id
        self._say(f"{session_id}: daemon {stage} restarted on {dead.socket} (pid {record.new_pid}) in {record.restart_s:.1f} s"
                  + (f"; {record.adoption_line}" if record.adoption_line else ""))

    def drain_and_restart(self, stage: int, at_ops: int) -> RestartRecord:
        """--restart: SIGTERM daemon `stage` (a drain: it finishes what is in flight, parks every session on its
        disk tier and exits 0), then start its successor on the same socket and spill dir, which adopts them.
        Meanwhile the sessions' clients wait for the successor and send again what the old daemon took nothing
        of (kvpool.client.successor)."""
        with self._lock:
            daemon = self._chain.daemons[stage]
            descendants = process_tree(daemon.process.pid)[1:]
            record = RestartRecord(daemon=stage, pid=daemon.process.pid, at_ops=at_ops, descendants=[p.pid for p in descendants])
            self._generations[stage] += 1  # a request whose reply the drain lost is explained (never sent again)
            self.restarts.append(record)
            self._say(f"draining daemon {stage} (SIGTERM to pid {record.pid}) after {at_ops} operations")
            began = time.monotonic()
            record.exit_code = daemon.stop(sig=signal.SIGTERM, timeout_s=DRAIN_HANG_GUARD_S)
            record.drain_s = round(time.monotonic() - began, 3)
            record.drain_line = log_line(daemon.log(), "drain done")
            gone = wait_gone(descendants, f"the workers of drained daemon {stage}", self._say)
            record.left_alive = [p.pid for p in gone.left_alive]
            record.workers_gone_s = gone.seconds
            kill_all(gone.left_alive)
            self._start_successor(stage, daemon, record, "drained")
        self._say(f"daemon {stage} drained in {record.drain_s:.1f} s (exit {record.exit_code}); its successor (pid {record.new_pid}) answered in {record.restart_s:.1f} s"
                  + (f"; {record.adoption_line}" if record.adoption_line else ""))
        return record

    def _start_successor(self, stage: int, old: Daemon, record: SupervisorKillRecord | RestartRecord, why: str) -> None:
        """Daemon `stage` again, on `old`'s socket with its flags (its spill dir too: what it left there is
        adopted); the start time and the states it adopted go in `record`."""
        if old.log_path.exists():
            old.log_path.rename(old.log_path.with_name(f"{old.socket.stem}.{why}-{self._generations[stage]}.log"))
        started = time.monotonic()
        try:
            daemon = Daemon(old.model, old.socket, self._chain.serve_options[stage])
            daemon.wait_ready()
        except DaemonStartFailed as error:
            record.restart_error = str(error)[:2000]
            raise
        self._chain.daemons[stage] = daemon
        record.restart_s, record.new_pid = round(time.monotonic() - started, 3), daemon.process.pid
        if self._chain.spill_dirs:
            record.adopted, record.adoption_line = adopted_states(daemon)

    def spill_dir(self, stage: int) -> pathlib.Path:
        return self._chain.spill_dirs[stage]


def log_line(log: str, marker: str) -> str:
    """The last line of a daemon's log holding `marker`, without its timestamp prefix ("" if none)."""
    line = next((line for line in reversed(log.splitlines()) if marker in line), "")
    return line[line.index(marker):] if line else ""


def adopted_states(daemon: Daemon) -> tuple[list[SavedState], str]:
    """The sessions a daemon just started holds parked on disk (what it adopted, less what a session has
    restored since), and its adoption log line."""
    with daemon.client(timeout_s=30, name="stress-adopted", direct=False) as client:
        rows = client.stats().sessions
    adopted = [SavedState(row.session_id, row.epoch, row.length) for row in rows if row.tier == "disk"]
    return adopted, log_line(daemon.log(), "adopted ")


def copies_in(spill_dir: pathlib.Path) -> dict[tuple[str, int], int]:
    """(session id, epoch) -> length of each state in a daemon's disk tier (--persist-after's copies written
    behind, parked states); a file replaced or removed while it is read is skipped."""
    found: dict[tuple[str, int], int] = {}
    for path in spill_dir.iterdir():
        if not OWN_FILE.fullmatch(path.name):
            continue
        try:
            header = read_header(path.read_bytes())
        except (OSError, StateRejected):
            continue
        key = (header.session_id, header.epoch)
        found[key] = max(found.get(key, -1), header.length)
    return found


class RollingRestart:
    """--restart: a thread that drains daemon 0, 1, ... of the route in turn while the sessions run, daemon i
    once the run has done (i + 1) / (n + 1) of its operations (bounded by operations, not time)."""

    def __init__(self, control: ChainControl, recorder: Recorder, n_stages: int, total_ops: int) -> None:
        self._control = control
        self._recorder = recorder
        self._thresholds = [total_ops * (stage + 1) // (n_stages + 1) for stage in range(n_stages)]
        self._stop = threading.Event()
        self.error = ""
        self._thread = threading.Thread(target=self._run, name="kvpool-stress-restarts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """After the sessions: no drain starts any more (one under way finishes first)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            for stage, threshold in enumerate(self._thresholds):
                while self._recorder.ops_done < threshold:
                    if self._stop.wait(RESTART_POLL_S):
                        return
                if self._stop.is_set():
                    return
                self._control.drain_and_restart(stage, self._recorder.ops_done)
        except (DaemonStartFailed, OSError) as error:
            self.error = str(error)[:2000]


def orphan_free(record: SupervisorKillRecord) -> bool:
    return not record.orphans_at_deadline and record.all_gone_s is not None

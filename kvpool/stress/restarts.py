"""--kill-supervisor: SIGKILL one daemon's supervisor, check that nothing of it survives, restart it.

Shared by the session threads. The session that carries the fault kills the supervisor (the generation of
that daemon goes up first, so any ConnectionLost after it is explained); whichever session first needs
the daemon again restarts it on the same socket path (`kvpool serve` replaces a socket file nothing
answers on); the others wait for that restart, reconnect and replay from 0 at a new epoch.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpool.client.client import Client
from kvpool.launcher import Daemon, DaemonStartFailed
from kvpool.stress.daemons import Chain
from kvpool.stress.processes import ORPHAN_DEADLINE_S, existing, kill_all, mapped_segments, process_tree, unlink_all, wait_gone
from kvpool.stress.report import SupervisorKillRecord

if TYPE_CHECKING:
    from kvpool.stress.tap import TappedClient

ORPHAN_WATCH_S = 30.0  # watched past the deadline only to report how late a straggler was (then killed)


class ChainControl:
    def __init__(self, chain: Chain, say: Callable[[str], None]) -> None:
        self._chain = chain
        self._say = say
        self._lock = threading.Lock()
        self._generations = [0] * len(chain.sockets)
        self._records: dict[int, SupervisorKillRecord] = {}
        self.kills: list[SupervisorKillRecord] = []

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
        """SIGKILL daemon `stage`'s supervisor; then watch its processes and segments (ORPHAN_DEADLINE_S)."""
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
        remaining = wait_gone(descendants, ORPHAN_DEADLINE_S - (time.monotonic() - killed_at))
        record.orphans_at_deadline = [p.pid for p in remaining]
        remaining = wait_gone(remaining, ORPHAN_WATCH_S)
        if not remaining:
            record.all_gone_s = round(time.monotonic() - killed_at, 3)
        kill_all(remaining)
        # Whatever unlinks a dead supervisor's segments (multiprocessing's resource tracker, one of the
        # descendants) has run by the time they are all gone; give it the same deadline otherwise.
        while existing(record.segments) and time.monotonic() < killed_at + ORPHAN_DEADLINE_S:
            time.sleep(0.05)
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
        record = self._records.get(stage)
        if record is not None and record.restart_error:
            raise DaemonStartFailed(record.restart_error)
        dead.stop()  # already reaped: closes its log and its lifeline
        if dead.log_path.exists():
            dead.log_path.rename(dead.log_path.with_name(f"{dead.socket.stem}.killed-{self._generations[stage]}.log"))
        started = time.monotonic()
        try:
            daemon = Daemon(dead.model, dead.socket, self._chain.serve_options[stage])
            daemon.wait_ready()
        except DaemonStartFailed as error:
            if record is not None:
                record.restart_error = str(error)[:2000]
            raise
        self._chain.daemons[stage] = daemon
        if record is not None:
            record.restarted_by, record.restart_s, record.new_pid = session_id, round(time.monotonic() - started, 3), daemon.process.pid
        self._say(f"{session_id}: daemon {stage} restarted on {dead.socket} (pid {daemon.process.pid}) in {time.monotonic() - started:.1f} s")


def orphan_free(record: SupervisorKillRecord) -> bool:
    return not record.orphans_at_deadline and record.all_gone_s is not None

"""--replan: mid-run, every session's route is re-planned onto a second chain of daemons with other split
points (--replan-parts shards of the same source), and later back onto the first (kvpool.router.Router.replan:
export, re-slice, import under epoch + 1). Every session must stay exact (the run alone knows nothing of
the moves: the same tokens at the same positions) and no session may be replayed: every re-plan of a session
that holds tokens is a move.

Each session re-plans itself between two of its operations, at a third and at two thirds of its planned
operations (or at the first operation after that which finds it holding tokens; at the latest before its
closing decodes), so sessions move while the others keep appending on either chain.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Sequence

from kvpool.client.client import Client
from kvpool.launcher import start_daemons
from kvpool.router.move import Moved, MoveFailed
from kvpool.shard.cache import shards_in_parts
from kvpool.stress.daemons import Chain
from kvpool.stress.report import ReplanRecord

Say = Callable[[str], None]


def open_replan_chain(source: pathlib.Path, parts: int, socket_dir: pathlib.Path, serve_options: Sequence[str], workers_expected: int | None, say: Say) -> Chain:
    """The second chain: daemons of the same source cut into `parts` at other split points, the first chain's flags."""
    shard_paths = [info.path for info in shards_in_parts(source, parts, progress=say)]
    say(f"--replan: starting a second chain of {parts} daemons cut at other split points")
    daemons = start_daemons(shard_paths, socket_dir, list(serve_options), prefix="replan")
    return Chain([daemon.socket for daemon in daemons], shard_paths, daemons, [], workers_expected, [list(serve_options)] * len(daemons))


def replan_points(ops: int) -> tuple[int, int]:
    """The operations before which a session re-plans onto the second chain, then back."""
    return max(1, ops // 3), max(2, 2 * ops // 3)


class SessionReplans:
    """One session's two re-plans: its clients of the second chain (opened at the start, closed at the end)
    and what each re-plan did."""

    def __init__(self, chain: Chain, session_id: str, ops: int) -> None:
        self.clients = [Client(path, name=session_id) for path in chain.sockets]
        self.points = replan_points(ops)
        self.records: list[ReplanRecord] = []

    def due(self, op_index: int) -> bool:
        return len(self.records) < len(self.points) and op_index >= self.points[len(self.records)]

    def record(self, session_id: str, onto: str, length: int, outcome: Moved | MoveFailed | None, seconds: float) -> ReplanRecord:
        record = ReplanRecord(
            session_id=session_id, onto=onto, length=length, seconds=round(seconds, 4),
            outcome="moved" if isinstance(outcome, Moved) else "failed" if isinstance(outcome, MoveFailed) else "nothing_held",
            moved_bytes=outcome.imported_bytes if isinstance(outcome, Moved) else 0,
            failure=str(outcome) if isinstance(outcome, MoveFailed) else "",
        )
        self.records.append(record)
        return record

    def close(self) -> None:
        for client in self.clients:
            client.close()


def timed(action: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    outcome = action()
    return outcome, time.monotonic() - started

"""One stress session's hold on the route: its kvpool.router.router session over tapped clients, the log of what
the daemons were made to hold, and what each request to a daemon came back with (the Tap of
kvpool.stress.tap).

Recovery is the router's (kvpool.router.session: a replay from 0 at a new epoch with the session's own
partition; a tail replay from the shortest length a daemon holds after a lost connection or a shorter
position_mismatch; over_budget retried after retry_after_s). The session logs what the daemons were made to
hold, for the run alone: a full replay inside an append as a reset and the session's appends again
(kvpool.stress.log.replayed). A tail replay is not logged: it must leave the daemons holding what they held
before, bit for bit, so the run alone (uninterrupted) checks it. A drain is not seen at all: the clients
wait for the daemon that follows and send again what the old one took nothing of (kvpool.client.successor).
`logits` is the output for position length - 1 when known.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.router.router import RecoveryPolicy, Router
from kvpool.stress.errors import ContractViolation
from kvpool.stress.log import LogEntry, LoggedAppend, LoggedReset, LoggedTruncate, replayed, row_digest
from kvpool.stress.options import StressOptions
from kvpool.stress.plans import SessionSetup
from kvpool.stress.recording import Recorder
from kvpool.stress.replans import SessionReplans, timed
from kvpool.stress.report import ReplanRecord
from kvpool.stress.restarts import ChainControl
from kvpool.stress.state import StageHook
from kvpool.stress.tap import Reconnected, TappedClient
from kvpool.wire.protocol import ErrorCode, MissReason

MAX_CONNECTION_RECOVERIES = 5
ADMIT_TIMEOUT_S = 60.0  # a session admitted on a full daemon waits in its line, first come first served
# Recovery is the router's; the stress only bounds it far above what a slow, busy machine needs.
POLICY = RecoveryPolicy(max_replays=200, over_budget_give_up_s=1800.0)


class AnswerWatcher(Protocol):
    """Told every daemon's answer (the session driver's fault drill, kvpool.stress.faults.FaultInjector)."""

    def answered(self, stage: int, error: KvpoolError | None) -> None: ...


class TappedSession:
    """The session as the daemons see it, and what they answered; kvpool.stress.driver.SessionDriver runs
    its plan on it."""

    faults: AnswerWatcher  # the session driver's fault drill

    def __init__(self, setup: SessionSetup, clients: Sequence[Client], options: StressOptions, recorder: Recorder, control: ChainControl | None = None) -> None:
        self.setup = setup
        self.session_id = setup.session_id
        self.options = options
        self.recorder = recorder
        self.control = control
        self.clients = [TappedClient(stage, client, self) for stage, client in enumerate(clients)]
        # Prefix reuse only where the scenario keeps every reuse checkable (kvpool.stress.prefixes): elsewhere a session
        # restarted with more than its prompt could take a prefix stored from other chunks than the run alone computes.
        self.router = Router(self.clients, policy=POLICY, seed=options.seed, prefix_cache=options.shared_prefix)
        self.session = self.router.session(setup.session_id, n_ctx=options.n_ctx, admit_timeout_s=ADMIT_TIMEOUT_S)
        self.logits: np.ndarray | None = None
        self.log: list[LogEntry] = []
        self.stage = -1  # the daemon an append is at right now; read by the canceller thread
        self.stage_hook: StageHook | None = None  # set by the operation that aims at a daemon (fault, cancel)
        self.cancelled_reply: tuple[int, int] | None = None  # (stage, length) of the last cancelled reply
        self._generations = control.generations() if control is not None else []
        self.misses: Counter[str] = Counter()
        self.appends = self.resets = self.connection_losses = self.restarts = 0
        self.restores = 0  # appends a daemon answered restored: true (parked, or adopted after a restart)
        self.release_reconnects = 0  # losses at the session's final release: released again, nothing to replay
        self._releasing = False
        self._unanswered_losses = 0  # reconnections the router has not answered with a replay at a new epoch
        self.admission_waits: list[float] = []  # seconds each admission took, queue and back-off included
        self.replans: SessionReplans | None = None  # --replan: the second chain's clients and the re-plans done
        self.first_clients = self.clients
        self.prefix_starts: list[int] = []  # the positions each fresh start of the session took from a stored prefix (0: none)
        self.first_start = threading.Event()  # its first append is done (or it ended without one)

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

    @property
    def full_replays(self) -> int:
        """Replays from position 0: the router's, and this driver's own after a lost connection (not durable)."""
        return self.session.counts.replays + self.restarts

    # ---- through the router ------------------------------------------------------------------------------

    def route_append(self, tokens: Sequence[int]) -> np.ndarray:
        """The router's append of `tokens` at the session's length: the last output row. A replay the router
        did first is logged here; the append itself is the caller's to log (took_effect)."""
        counts = self.session.counts
        before, partition, replays, lost = self.session.tokens, self.session.partition, counts.replays, counts.connections_lost
        fresh, reused = not before, counts.prefix_hit_tokens
        try:
            rows = self.session.append(list(tokens))
        finally:
            if fresh and self.session.length:  # a prefix is logged as part of the append: the run alone computes it in that chunk
                self.prefix_starts.append(counts.prefix_hit_tokens - reused)
                self.first_start.set()
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

    def replan(self) -> ReplanRecord:
        """Re-plan the session's route (kvpool.router.Router.replan) onto the second chain, or back onto the
        first; the daemons hold the same tokens afterwards, so nothing is logged for the run alone."""
        assert self.replans is not None
        onto_second = len(self.replans.records) % 2 == 0
        if onto_second:
            target = [TappedClient(stage, client, self) for stage, client in enumerate(self.replans.clients)]
        else:
            target = self.first_clients
        length = self.length
        replanned, seconds = timed(lambda: self.router.replan(target))
        self.clients = target
        outcome = replanned.moved.get(self.session_id) or replanned.failed.get(self.session_id)
        name = f"{'second' if onto_second else 'first'} chain ({len(target)} shards)"
        return self.replans.record(self.session_id, name, length, outcome, seconds)

    def start_over(self) -> None:
        """Release the session everywhere (at the router session's epoch); the next append starts from 0."""
        self._release_all()
        self.log.append(LoggedReset())
        self.logits = None
        self.resets += 1

    def _release_all(self) -> None:
        self._releasing = True  # a connection lost now needs no replay: the release is sent again
        try:
            for _ in range(MAX_CONNECTION_RECOVERIES):
                try:
                    self.session.release()
                    return
                except ConnectionLost:
                    continue  # the tap reconnected to a restarted daemon: release again
            raise ContractViolation(f"{self.session_id}: still losing connections after {MAX_CONNECTION_RECOVERIES} releases")
        finally:
            self._releasing = False

    # ---- the tap: each request to a daemon (kvpool.stress.tap) ---------------------------------------------

    def sending(self, stage: int, start_pos: int, rows: int) -> None:
        self.stage = stage
        if self.stage_hook is not None:
            self.stage_hook(stage, start_pos, rows)

    def answered(self, stage: int, error: KvpoolError | None, *, admitted: bool = False, waited_s: float = 0.0, restored: bool = False) -> None:
        self.stage = -1
        if admitted:
            self.admission_waits.append(waited_s)
        if restored:
            self.restores += 1
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
        """Only a drill that stopped a daemon (a killed supervisor, a drain) explains a lost connection:
        reconnect to every daemon restarted since this session last looked (kvpool.stress.restarts), or fail the run."""
        self.stage = -1
        if self.control is None or not self.control.reconnect(self._generations, self.clients, self.session_id):
            raise ContractViolation(f"connection lost (did a daemon die?): {error}")
        if self._releasing:
            self.release_reconnects += 1
            return
        self.connection_losses += 1
        self._unanswered_losses += 1
        self.recorder.event("connection lost (daemon restarted): the router replays what it lacks" if self.options.durable
                            else "connection lost (supervisor killed): replayed at a new epoch")

    def _survive(self, action: Callable[[], object]) -> None:
        """Run `action`. A connection lost where the router did not replay (a truncate, a release, a probe's
        or a drill's own request): with a disk tier (--restart, --persist-after) the router's next append
        finds what the restarted daemon holds (position_mismatch: the tail; cache_miss: from 0), so nothing
        is done here; without one, it is answered here as the router would: start again from 0 at a new epoch."""
        for _ in range(MAX_CONNECTION_RECOVERIES):
            try:
                action()
            except ConnectionLost as error:
                if not isinstance(error, Reconnected):
                    self.lost(-1, error)
            if not self._unanswered_losses:
                return
            self._unanswered_losses = 0
            if self.options.durable:
                return
            self.restarts += 1
            self.epoch += 1
            action = self.start_over
        raise ContractViolation(f"{self.session_id}: still losing connections after {MAX_CONNECTION_RECOVERIES} recoveries")

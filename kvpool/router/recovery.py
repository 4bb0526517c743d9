"""What kvpool.router.router's recovery may cost and what it answers: its knobs (back-off, limits), its counts,
which failures it replays, and the two ways an append ends without its rows."""

from __future__ import annotations

import dataclasses
import random

from kvpool.client.client import ConnectionLost
from kvpool.router.route import StageFailed
from kvpool.wire.protocol import ErrorCode


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    """How kvpool.router.router backs off and when it gives up."""

    backoff_base_s: float = 0.02  # the first back-off; it doubles with every further try, up to:
    backoff_max_s: float = 2.0
    over_budget_give_up_s: float = 120.0  # per daemon admission, then over_budget is raised
    max_replays: int = 8  # replays in a row without the append getting through, then RecoveryFailed
    exact_replay: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_base_s <= backoff_max_s")
        if self.over_budget_give_up_s < 0 or self.max_replays < 1:
            raise ValueError("need over_budget_give_up_s >= 0 and max_replays >= 1")

    def delay_s(self, attempt: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """The wait before try `attempt` + 1 (0-based): the daemon's hint as given (the caller bounds it by
        its deadline), else exponential, half of it fixed and half random."""
        if retry_after_s is not None and retry_after_s >= 0:
            return retry_after_s
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** min(attempt, 30))
        return ceiling / 2 + rng.uniform(0, ceiling / 2)


@dataclasses.dataclass(slots=True)
class RecoveryCounts:
    cache_misses: int = 0  # cache_miss replies that started a replay
    workers_lost: int = 0  # worker_lost replies that started a replay
    connections_lost: int = 0  # ConnectionLost that started a replay
    epoch_floor_restarts: int = 0  # stale_epoch below a daemon's epoch floor: the session took an epoch at the floor
    replays: int = 0  # full replays (from position 0) that got through
    replayed_tokens: int = 0  # the tokens full replays sent
    position_mismatches: int = 0  # position_mismatch replies naming a shorter length (a state written behind, adopted after a crash)
    tail_replays: int = 0  # replays from the shortest length a daemon held that got through
    tail_replayed_tokens: int = 0  # the tokens tail replays sent
    over_budget_retries: int = 0
    rollbacks: int = 0  # earlier daemons truncated back after a cancel or failure further on
    moves: int = 0  # sessions a re-plan moved onto the new route (export, re-slice, import: no replay)
    moved_bytes: int = 0  # the sealed state bytes those moves imported
    move_failures: int = 0  # sessions whose move failed: each replays on the new route (counted in replays)
    # shared prefixes (kvpool.router.prefix), on a session's first append and on replays:
    prefix_hits: int = 0  # sessions (or replays) started from a prefix every daemon of the route held
    prefix_hit_tokens: int = 0  # the positions they did not compute
    prefix_fallbacks: int = 0  # lookups that found a prefix whose admission then failed somewhere (computed instead)


class Cancelled(Exception):
    """The append was cancelled at daemon `stage`; the session is as it was before the append."""

    def __init__(self, stage: int) -> None:
        super().__init__(f"the append was cancelled at daemon {stage}")
        self.stage = stage


class RecoveryFailed(Exception):
    """The policy gave up: `max_replays` replays in a row did not get the append through."""


def replay_counter(failure: StageFailed | ConnectionLost) -> str | None:
    """The count a failure adds to when the policy answers it with a replay; None when it does not."""
    if isinstance(failure, ConnectionLost):
        return "connections_lost"
    if failure.code == ErrorCode.STALE_EPOCH and epoch_floor_of(failure) > 0:
        return "epoch_floor_restarts"
    return {ErrorCode.CACHE_MISS: "cache_misses", ErrorCode.WORKER_LOST: "workers_lost"}.get(failure.code)


def epoch_floor_of(failure: StageFailed | ConnectionLost) -> int:
    """A stale_epoch reply's epoch floor (kvpool.daemon.books.sessions: below it a daemon refuses ids it does not know); 0 if none."""
    reply = getattr(failure, "reply", None)
    return getattr(reply, "epoch_floor", 0) or 0

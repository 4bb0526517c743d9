"""What kvpool.router's recovery may cost: its knobs (back-off, limits) and its counts."""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    """How kvpool.router backs off and when it gives up."""

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
    replays: int = 0  # replays from position 0 that got through
    replayed_tokens: int = 0
    over_budget_retries: int = 0
    rollbacks: int = 0  # earlier daemons truncated back after a cancel or failure further on

"""Residency: an idle session that appended recently is not evicted to admit another.

A session's token walks the route: while it is computed on the daemons after this one and the router picks
the next token, the session is idle here, and plain LRU eviction takes it, so it misses on its next step and
replays the whole route: with more sessions than places nobody finishes (issue 13). So a session that
appended within the last `min_residency_s` is protected: an admission evicts only idle sessions older than
that, least recently used first, and when every candidate is protected it waits for the first protection
to lapse instead of evicting (kvpool.daemon.admission.queue).

The default is a few of this route's steps: the shard's decode step measured at start-up
(kvpool.daemon.admission.calibration), times the shards a route of equal shards would have (total layers / local layers),
times RESIDENCY_ROUTE_STEPS, and never below MIN_RESIDENCY_FLOOR_S (the router's own time, the hops and a
busy machine's scheduling do not shrink with the step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from kvpool.daemon.books.sessions import Session
from kvpool.wire.shape import ShardShape

RESIDENCY_ROUTE_STEPS = 8  # whole route steps a session is protected for after its last append
MIN_RESIDENCY_FLOOR_S = 0.25
FALLBACK_STEP_S = 0.05  # when no step was measured (no calibration ran)


def derived_min_residency_s(step_s: float | None, shape: ShardShape) -> float:
    """A few route steps of this shard's measured decode step, at least MIN_RESIDENCY_FLOOR_S."""
    shards_in_route = max(1, math.ceil(shape.total_layers / max(1, shape.n_layers)))
    step = FALLBACK_STEP_S if step_s is None else step_s
    return max(MIN_RESIDENCY_FLOOR_S, RESIDENCY_ROUTE_STEPS * shards_in_route * step)


@dataclasses.dataclass(frozen=True, slots=True)
class Residency:
    min_s: float

    def protected_after(self, now: float) -> float:
        """Sessions last used after this instant are protected from eviction at `now`."""
        return now - self.min_s

    def next_lapse(self, idle: Iterable[Session], now: float) -> float | None:
        """When the first protection of these idle sessions lapses (None: none of them is protected)."""
        lapses = [session.last_used + self.min_s for session in idle if session.last_used + self.min_s > now]
        return min(lapses, default=None)

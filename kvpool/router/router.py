"""kvpool.router.router: how a router embeds kvpool. A `Router` holds a checked route of shard daemons, the
recovery policy and the recovery counts of all its sessions; each session (kvpool.router.session) walks
its appends through the route and decides, in one place, what a failure means: replay, back off, roll
back. The knobs are a RecoveryPolicy and what recovery did is counted in RecoveryCounts (kvpool.router.recovery).
`replan` switches the router and every session it made onto a new route, moving their states (kvpool.router.move).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import weakref
from collections.abc import Sequence

from kvpool.client.client import Client
from kvpool.router.move import Moved, MoveFailed
from kvpool.router.recovery import Cancelled, RecoveryCounts, RecoveryFailed, RecoveryPolicy
from kvpool.router.route import Route
from kvpool.router.session import RoutedSession

__all__ = ["Cancelled", "Replanned", "RecoveryCounts", "RecoveryFailed", "RecoveryPolicy", "RoutedSession", "Router"]


@dataclasses.dataclass(slots=True)
class Replanned:
    """What one re-plan did to each live session: moved (its state), failed (MoveFailed: it replays on the
    new route at its next append), or replays (its daemons may not have held its tokens)."""

    moved: dict[str, Moved] = dataclasses.field(default_factory=dict)
    failed: dict[str, MoveFailed] = dataclasses.field(default_factory=dict)
    replays: list[str] = dataclasses.field(default_factory=list)

    @property
    def moved_bytes(self) -> int:
        return sum(moved.imported_bytes for moved in self.moved.values())


class Router:
    """A checked route of shard daemons (clients first to last; not owned: the caller closes them), the
    recovery policy, and the recovery counts of all its sessions. Sessions may run in parallel threads."""

    def __init__(self, clients: Sequence[Client], *, policy: RecoveryPolicy | None = None, seed: int | None = None, prefix_cache: bool = True) -> None:
        """`prefix_cache`: start each new session (and each replay from 0) from the longest prefix of its
        tokens every daemon's prefix store holds (README, "Shared prefixes")."""
        self.route = Route(clients)
        self.prefix_cache = prefix_cache
        self.policy = policy or RecoveryPolicy()
        self._seed = seed
        self._lock = threading.Lock()
        self._counts = RecoveryCounts()
        self._sessions: weakref.WeakSet[RoutedSession] = weakref.WeakSet()

    @property
    def clients(self) -> list[Client]:
        return self.route.clients

    def session(self, session_id: str, *, epoch: int = 1, n_ctx: int = 0, admit_timeout_s: float = 0.0, prefix_scope: str = "") -> RoutedSession:
        """`prefix_scope`: sessions share stored prefixes only within one scope (a tenant's name, say); a lookup
        of one scope learns nothing of another's. The default "" is one scope for every session that names none."""
        with self._lock:
            session = RoutedSession(
                self.route, self.policy, session_id, epoch=epoch, n_ctx=n_ctx, admit_timeout_s=admit_timeout_s,
                rng=self._rng(session_id), count=self._count, prefix_cache=self.prefix_cache, prefix_scope=prefix_scope,
            )
            self._sessions.add(session)
        return session

    def replan(self, clients: Sequence[Client]) -> Replanned:
        """Switch onto the route of `clients` (checked as a whole model; not owned: the caller closes the old
        clients once this returns): same split points (a host replaced) or others, any number of shards of
        the same source. Every live session made by this router moves its state there under epoch + 1 and
        its old epoch is released; one whose move fails replays on the new route alone, at its next append.
        Sessions are moved one at a time, each between two of its appends; new sessions start on the new route."""
        route = Route(clients)
        with self._lock:
            self.route = route
            sessions = list(self._sessions)
        replanned = Replanned()
        for session in sessions:
            outcome = session.move_to(route)
            if isinstance(outcome, Moved):
                replanned.moved[session.session_id] = outcome
            elif isinstance(outcome, MoveFailed):
                replanned.failed[session.session_id] = outcome
            else:
                replanned.replays.append(session.session_id)
        return replanned

    @property
    def counts(self) -> RecoveryCounts:
        """A snapshot of the counts summed over every session of this router."""
        with self._lock:
            return dataclasses.replace(self._counts)

    def _count(self, field: str, amount: int) -> None:
        with self._lock:
            setattr(self._counts, field, getattr(self._counts, field) + amount)

    def _rng(self, session_id: str) -> random.Random:
        return random.Random(None if self._seed is None else f"{self._seed}:{session_id}")

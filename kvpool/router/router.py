"""kvpool.router.router: how a router embeds kvpool. A `Router` holds a checked route of shard daemons, the
recovery policy and the recovery counts of all its sessions; each session (kvpool.router.session) walks
its appends through the route and decides, in one place, what a failure means: replay, back off, roll
back. The knobs are a RecoveryPolicy and what recovery did is counted in RecoveryCounts (kvpool.router.recovery).
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Sequence

from kvpool.client.client import Client
from kvpool.router.recovery import Cancelled, RecoveryCounts, RecoveryFailed, RecoveryPolicy
from kvpool.router.route import Route
from kvpool.router.session import RoutedSession

__all__ = ["Cancelled", "RecoveryCounts", "RecoveryFailed", "RecoveryPolicy", "RoutedSession", "Router"]


class Router:
    """A checked route of shard daemons (clients first to last; not owned: the caller closes them), the
    recovery policy, and the recovery counts of all its sessions. Sessions may run in parallel threads."""

    def __init__(self, clients: Sequence[Client], *, policy: RecoveryPolicy | None = None, seed: int | None = None) -> None:
        self.route = Route(clients)
        self.policy = policy or RecoveryPolicy()
        self._seed = seed
        self._lock = threading.Lock()
        self._counts = RecoveryCounts()

    @property
    def clients(self) -> list[Client]:
        return self.route.clients

    def session(self, session_id: str, *, epoch: int = 1, n_ctx: int = 0, admit_timeout_s: float = 0.0) -> RoutedSession:
        return RoutedSession(
            self.route, self.policy, session_id, epoch=epoch, n_ctx=n_ctx, admit_timeout_s=admit_timeout_s,
            rng=self._rng(session_id), count=self._count,
        )

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

"""kvpool.router: how a router embeds kvpool. A `Router` holds a checked route of shard daemons, the recovery
policy and the counts of all its sessions; each session walks its appends through the route, and what a
failure means is decided in one place (kvpool.router.session)."""

from kvpool.router.recovery import Cancelled, RecoveryCounts, RecoveryFailed, RecoveryPolicy
from kvpool.router.route import Route, StageFailed
from kvpool.router.move import Moved, MoveFailed
from kvpool.router.router import Replanned, Router
from kvpool.router.session import RoutedSession

__all__ = ["Cancelled", "Moved", "MoveFailed", "RecoveryCounts", "RecoveryFailed", "RecoveryPolicy", "Replanned", "Route", "RoutedSession", "Router", "StageFailed"]

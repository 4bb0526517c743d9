"""Kept for kvpool.stress until it moves to kvpool.router: the old name of kvpool.route.Route (one walk
through a route of daemons, no recovery). New code uses kvpool.router."""

from kvpool.route import Route as DaemonRoute

__all__ = ["DaemonRoute"]

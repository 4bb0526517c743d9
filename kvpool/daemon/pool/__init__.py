"""The daemon's worker processes: each one's typed handle and process, their shared-memory segments, the
compute slots, the direct channels' supervisor side, and what happens to a worker between sessions."""

from kvpool.daemon.pool.errors import WorkerFailed, WorkerLost, WorkerStartFailed
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.daemon.pool.spec import PoolSpec

__all__ = ["PoolSpec", "WorkerFailed", "WorkerLost", "WorkerPool", "WorkerStartFailed"]

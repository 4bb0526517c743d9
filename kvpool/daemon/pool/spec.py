"""PoolSpec: what every worker process of a pool is started with (one WorkerSpec), and how the pool treats them.

`kinds` is the seam at the worker pipe: the classes the pool starts for a process-mode worker and a batched
one (kvpool.daemon.pool.handle.WorkerHandle and kvpool.daemon.pool.batched.BatchedWorker when None). A test
double of kvpool's own worker (tests/support/fake_worker.py) subclasses them, answering the same pipe
commands in-process; the daemon never names one itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpool.host import direct_frame_deadline_s
from workers.server.spec import FRAME_DEADLINE_S, WorkerSpec


@dataclass(frozen=True, slots=True)
class PoolSpec:
    worker: WorkerSpec  # the settings every worker shares; its own fields are filled in by worker_spec()
    size: int
    ready_timeout_s: float
    request_timeout_s: float  # a call not answered by then: the worker is killed and counts as lost
    direct: bool = True  # each worker also listens on its direct channel
    kinds: tuple[type, type] | None = None  # (process-mode worker, batched worker) classes; None: the real ones
    compute_slots: int = 0  # at most this many workers compute at once, bounded by a semaphore the pool creates (0: no bound) ...
    compute_records: str = ""  # ... recorded under this prefix (beside the socket; workers.server.compute_semaphore)

    def worker_spec(self, **own) -> WorkerSpec:
        """One worker's WorkerSpec: the shared settings and `own` (its segment's name, parent, channel address, index)."""
        return dataclasses.replace(self.worker, **own)


def shared_settings(**settings) -> WorkerSpec:
    """The WorkerSpec every worker of this daemon shares: `settings`, and the direct channel's frame deadline
    as the host's environment sets it (kvpool.host)."""
    settings.setdefault("frame_deadline_s", direct_frame_deadline_s(FRAME_DEADLINE_S))
    return WorkerSpec(**settings)

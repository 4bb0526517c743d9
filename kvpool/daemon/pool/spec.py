"""PoolSpec: what every worker process of a pool is started with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpool.host import direct_frame_deadline_s
from workers.server.segment import SegmentLayout
from workers.server.spec import FRAME_DEADLINE_S
from workers.server.spec import WorkerSpec


@dataclass(frozen=True, slots=True)
class PoolSpec:
    shard_path: str
    size: int
    segment: SegmentLayout
    n_threads: int
    flash_attn: bool
    ready_timeout_s: float
    request_timeout_s: float  # a call not answered by then: the worker is killed and counts as lost
    n_gpu_layers: int = 0
    verbose: bool = False
    direct: bool = True  # each worker also listens on its direct channel
    max_n_ctx: int = 0
    compute_lock_path: str = ""  # at most compute_slots workers compute at once (across processes)
    compute_slots: int = 1
    seqs_per_worker: int = 0  # > 0: batched workers (kvpool.daemon.pool.batched), each serving this many sessions
    # a frame on a direct channel passes whole within this, or its peer is dropped (workers.server.direct)
    frame_deadline_s: float = dataclasses.field(default_factory=lambda: direct_frame_deadline_s(FRAME_DEADLINE_S))

    def worker_spec(self, **per_worker) -> WorkerSpec:
        """One worker's WorkerSpec: the settings the pool's workers share (the fields both specs name), and
        `per_worker` (its segment, parent, channel address, index)."""
        shared = {field.name: getattr(self, field.name) for field in dataclasses.fields(WorkerSpec) if hasattr(self, field.name)}
        return WorkerSpec(**shared, **per_worker)

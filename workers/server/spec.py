"""What a worker process is started with (picklable for `spawn`)."""

from __future__ import annotations

from dataclasses import dataclass

from workers.server.background import BACKGROUND_NICE
from workers.server.segment import SegmentRegions
from workers.server.spin import DEFAULT_IDLE_SPIN

FRAME_DEADLINE_S = 30.0  # the default of WorkerSpec.frame_deadline_s
MAX_FRAME_BYTES = 256 * 1024 * 1024  # the default of WorkerSpec.max_request_bytes


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to start; picklable for `spawn`. The settings first (every worker of a
    daemon shares them: kvpool.daemon.pool.spec.PoolSpec holds them as one WorkerSpec), then what each
    worker has of its own (filled in as it is spawned)."""

    shard_path: str
    segment: SegmentRegions  # the sizes of its shared-memory segment's regions
    n_threads: int
    flash_attn: bool
    n_gpu_layers: int = 0
    verbose: bool = False
    max_n_ctx: int = 0  # the daemon's largest context (the direct channel checks appends as the daemon does)
    compute_semaphore: int = -1  # the semaphore bounding the workers computing at once (workers.server.compute_semaphore; -1: no bound), set by the pool as it starts
    seqs_per_worker: int = 0  # > 0: a batched worker, one context of this many sequences of max_n_ctx positions each
    frame_deadline_s: float = FRAME_DEADLINE_S  # a direct channel's frame (request or reply) passes whole within this, or its peer is dropped
    max_request_bytes: int = MAX_FRAME_BYTES  # a direct channel's largest request frame (the daemon's --max-request-bytes): its peer is dropped past it
    huge_pages: bool = True  # the load's own anonymous memory collapsed into transparent huge pages (workers.runtime.huge_pages)
    background_nice: int = BACKGROUND_NICE  # saves no caller waits for run this much nicer (workers.server.background; 0: in the loop's thread)
    idle_spin: int = DEFAULT_IDLE_SPIN  # how long llama.cpp's idle threads spin before they sleep (workers.server.spin)
    keep_warm_block: str = ""  # the daemon's --keep-warm stamp (kvpool.daemon.keep_warm), touched after each direct append ("": off)
    # each worker's own
    shm_name: str = ""  # its segment, created by the supervisor
    parent_pid: int = 0
    direct_address: str = ""  # the direct channel's abstract socket name ("" : no direct channel)
    worker_index: int = 0

    @property
    def input_bytes(self) -> int:
        return self.segment.input_bytes

    @property
    def output_bytes(self) -> int:
        return self.segment.output_bytes

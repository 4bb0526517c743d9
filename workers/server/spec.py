"""What a worker process is started with (picklable for `spawn`)."""

from __future__ import annotations

from dataclasses import dataclass

FRAME_DEADLINE_S = 30.0  # the default of WorkerSpec.frame_deadline_s


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to start; picklable for `spawn`."""

    shard_path: str
    shm_name: str
    input_bytes: int
    output_bytes: int
    n_threads: int
    flash_attn: bool
    parent_pid: int
    n_gpu_layers: int = 0
    verbose: bool = False
    direct_address: str = ""  # the direct channel's abstract socket name ("" : no direct channel)
    max_n_ctx: int = 0  # the daemon's largest context (the direct channel checks appends as the daemon does)
    compute_lock_path: str = ""  # at most compute_slots workers of the daemon compute at once ("": no limit)
    compute_slots: int = 1
    worker_index: int = 0
    seqs_per_worker: int = 0  # > 0: a batched worker, one context of this many sequences of max_n_ctx positions each
    frame_deadline_s: float = FRAME_DEADLINE_S  # a direct channel's frame (request or reply) passes whole within this, or its peer is dropped

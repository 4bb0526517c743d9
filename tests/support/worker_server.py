"""A worker's command server (workers.server.single.WorkerServer) on a loaded model in the test's own process,
with a segment sized for `input_rows` rows of the first shard: what a worker process runs, without the process."""

from __future__ import annotations

from multiprocessing import shared_memory

from workers.runtime.model import ShardModel
from workers.server.background import BACKGROUND_NICE
from workers.server.segment import SegmentRegions
from workers.server.single import WorkerServer
from workers.server.spec import WorkerSpec


def worker_server(
    model: ShardModel, segment: shared_memory.SharedMemory, input_rows: int, n_embd: int, max_n_ctx: int, *, background_nice: int = BACKGROUND_NICE
) -> WorkerServer:
    spec = WorkerSpec(
        shard_path=str(model.path), shm_name=segment.name,
        segment=SegmentRegions(input_bytes=input_rows * 4, output_bytes=input_rows * n_embd * 4),
        n_threads=1, flash_attn=False, parent_pid=0, max_n_ctx=max_n_ctx, background_nice=background_nice,
    )
    return WorkerServer(model, segment, spec)

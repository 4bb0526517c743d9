"""`kvpool serve --mode auto`: which schedule decodes N sessions faster on this machine, measured once at
start-up on the daemon's own shard with its own thread budget (a few seconds), before any worker starts.

- process: what --mode process computes: `threads` worker processes of one llama thread, each decoding its
  share of the N sessions one row at a time, each session its own context (no IPC: its ceiling);
- batched: what --mode batched computes: one process with `threads` llama threads, the N sessions as
  sequences of one context, every decode step one N-row batch.

Each runs in spawned processes of its own, one after the other, so neither shares cores with the other.
Process mode's real rate stays under this ceiling (IPC), so a pick of process mode is only as good as the
ceiling's margin; the status line shows both rates.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time

import numpy as np

from workers.server.spin import DEFAULT_IDLE_SPIN, set_idle_spin

PROBE_PREFILL_ROWS = 8
PROBE_WARMUP_STEPS = 2
PROBE_STEPS = 12


@dataclasses.dataclass(frozen=True, slots=True)
class ModeChoice:
    mode: str
    process_tok_s: float
    batched_tok_s: float

    @property
    def reason(self) -> str:
        return (f"--mode auto picked {self.mode}: measured at start-up, batched {self.batched_tok_s:.0f} tok/s vs "
                f"process {self.process_tok_s:.0f} tok/s (its no-IPC ceiling)")


def _rows(shape, count: int, rng: np.random.Generator):
    if shape.is_first:
        return rng.integers(0, shape.n_vocab, count).astype(np.int32)
    return rng.standard_normal((count, shape.n_embd)).astype(np.float32)


def _process_share(connection, shard_path: str, n_ctx: int, sessions: int, barrier, huge_pages: bool, idle_spin: int) -> None:
    set_idle_spin(idle_spin)  # as a worker's (workers.server.entry), before llama.cpp loads
    from workers.runtime.model import ShardModel

    rng = np.random.default_rng(0)
    with ShardModel(shard_path, n_threads=1, huge_pages=huge_pages) as model:
        contexts = [model.new_context(n_ctx) for _ in range(sessions)]
        for context in contexts:
            context.append(0, **_kwargs(model.shape, _rows(model.shape, PROBE_PREFILL_ROWS, rng)))
        barrier.wait()
        started = 0.0
        for step in range(PROBE_WARMUP_STEPS + PROBE_STEPS):
            if step == PROBE_WARMUP_STEPS:
                started = time.perf_counter()
            for context in contexts:
                context.append(context.length, **_kwargs(model.shape, _rows(model.shape, 1, rng)))
        connection.send((started, time.perf_counter()))


def _batched_run(connection, shard_path: str, n_ctx: int, sessions: int, threads: int, huge_pages: bool, idle_spin: int) -> None:
    set_idle_spin(idle_spin)  # as a worker's (workers.server.entry), before llama.cpp loads
    from workers.runtime.batch_plan import SeqAppend
    from workers.runtime.batched import BatchedShardContext
    from workers.runtime.model import ShardModel

    rng = np.random.default_rng(0)
    with ShardModel(shard_path, n_threads=threads, huge_pages=huge_pages) as model:
        with BatchedShardContext(model, n_ctx, sessions, n_batch=512) as context:
            context.append_many([SeqAppend(seq, 0, _rows(model.shape, PROBE_PREFILL_ROWS, rng)) for seq in range(sessions)])
            started = 0.0
            for step in range(PROBE_WARMUP_STEPS + PROBE_STEPS):
                if step == PROBE_WARMUP_STEPS:
                    started = time.perf_counter()
                context.append_many([SeqAppend(seq, context.length(seq), _rows(model.shape, 1, rng)) for seq in range(sessions)])
            connection.send((started, time.perf_counter()))


def _kwargs(shape, rows) -> dict:
    return {"tokens": rows} if shape.is_first else {"hidden": rows}


def _run(target, args_per_process: list[tuple]) -> float:
    """Spawn one process per args tuple, return the span from the earliest start to the latest end."""
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for args in args_per_process:
        parent_end, child_end = context.Pipe(duplex=False)
        process = context.Process(target=target, args=(child_end, *args), name="kvpool-mode-probe", daemon=True)
        process.start()
        child_end.close()
        pipes.append(parent_end)
        processes.append(process)
    try:
        spans = [pipe.recv() for pipe in pipes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    return max(end for _start, end in spans) - min(start for start, _end in spans)


def probe_modes(shard_path: str, *, sessions: int, threads: int, n_ctx: int, huge_pages: bool = True, idle_spin: int = DEFAULT_IDLE_SPIN) -> ModeChoice:
    """Blocking; a few seconds. n_ctx: per session (small is enough: the probe's sessions stay short); `huge_pages`
    and `idle_spin`: the loads and threads as the workers' (--huge-pages, --idle-spin)."""
    workers = max(1, min(threads, sessions))
    shares = [len(range(index, sessions, workers)) for index in range(workers)]
    barrier = multiprocessing.get_context("spawn").Barrier(workers)
    process_s = _run(_process_share, [(shard_path, n_ctx, share, barrier, huge_pages, idle_spin) for share in shares])
    batched_s = _run(_batched_run, [(shard_path, n_ctx, sessions, threads, huge_pages, idle_spin)])
    tokens = sessions * PROBE_STEPS
    process_tok_s, batched_tok_s = tokens / process_s, tokens / batched_s
    return ModeChoice("batched" if batched_tok_s > process_tok_s else "process", process_tok_s, batched_tok_s)

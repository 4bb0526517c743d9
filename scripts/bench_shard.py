"""Benchmark: the capture path of a middle shard against llama.cpp running the same shard without capture.

Both variants run the same shard file, the same hidden-state inputs and the same positions, interleaved
round by round in one process (the machine is shared and noisy: compare the ratios, not the times).

  baseline  llama.cpp context on the shard, no eval callback, output of the last row only
  all-rows  the same, every row marked as output (what a non-final shard must compute; explains the prefill gap)
  kvpool    workers.runtime.context.ShardContext: C eval callback captures l_out-(n-1) of every row and stops the graph

Usage: python scripts/bench_shard.py [--rounds 7] [--decode-steps 64] [--prefill 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import llama_cpp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvpool.local.tokenizer import Tokenizer  # noqa: E402
from kvpool.shard.bundled import bundled_model_path  # noqa: E402
from kvpool.shard.cache import shards_in_parts  # noqa: E402
from kvpool.shard.header import file_sha256  # noqa: E402
from workers.runtime.model import ShardModel  # noqa: E402

DECODE_TARGET = 1.05
PREFILL_TARGET = 1.10


class PlainContext:
    """llama.cpp on the shard with no callback: hidden states in, last-row output, nothing captured."""

    def __init__(self, model: ShardModel, n_ctx: int, n_batch: int, *, every_row: bool = False) -> None:
        self.every_row = every_row
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = model.n_threads
        params.no_perf = True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(model.handle, params)
        assert self.ctx
        self.n_embd = model.shape.n_embd
        self.batch = llama_cpp.llama_batch_init(n_batch, self.n_embd, 1)
        self.embd = np.ctypeslib.as_array(self.batch.embd, shape=(n_batch, self.n_embd))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))
        self.outputs = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))
        for row in range(n_batch):
            self.batch.n_seq_id[row] = 1
            self.batch.seq_id[row][0] = 0
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def append(self, start_pos: int, hidden: np.ndarray) -> None:
        rows = hidden.shape[0]
        self.embd[:rows] = hidden
        self.pos[:rows] = np.arange(start_pos, start_pos + rows, dtype=np.int32)
        self.outputs[:rows] = 1 if self.every_row else 0
        self.outputs[rows - 1] = 1
        self.batch.n_tokens = rows
        status = llama_cpp.llama_decode(self.ctx, self.batch)
        assert status == 0, status

    def truncate(self, n: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, 0, n, -1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


class CaptureContext:
    def __init__(self, model: ShardModel, n_ctx: int, n_batch: int) -> None:
        self.context = model.new_context(n_ctx, n_batch=n_batch)

    def append(self, start_pos: int, hidden: np.ndarray) -> None:
        self.context.append(start_pos, hidden=hidden)

    def truncate(self, n: int) -> None:
        self.context.truncate(n)

    def close(self) -> None:
        self.context.close()


def measure_decode(context, hidden: np.ndarray, history: int, steps: int) -> float:
    """Median seconds of one decode step after `history` rows of context."""
    context.truncate(0)
    context.append(0, hidden[:history])
    times = []
    for step in range(steps):
        row = hidden[history + step : history + step + 1]
        started = time.perf_counter()
        context.append(history + step, row)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_prefill(context, hidden: np.ndarray, rows: int) -> float:
    context.truncate(0)
    started = time.perf_counter()
    context.append(0, hidden[:rows])
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, help="source GGUF (default: the bundled model)")
    parser.add_argument("--parts", type=int, default=3, help="cut into N shards and bench the middle one (default 3)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per variant (default 7)")
    parser.add_argument("--decode-steps", type=int, default=64, help="decode steps per round (default 64)")
    parser.add_argument("--history", type=int, default=64, help="rows in the context before decoding (default 64)")
    parser.add_argument("--prefill", type=int, default=256, help="prefill rows (default 256)")
    parser.add_argument("--threads", type=int, default=1, help="llama threads (default 1)")
    parser.add_argument("--json", type=pathlib.Path, help="write the raw figures here")
    args = parser.parse_args()

    source = args.model or bundled_model_path()
    shards = shards_in_parts(source, args.parts, progress=lambda m: print(f"# {m}", file=sys.stderr))
    first, middle = shards[0], shards[len(shards) // 2]
    needed = max(args.prefill, args.history + args.decode_steps)
    n_ctx = max(512, needed)

    with Tokenizer(first.path) as tokenizer:
        text = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. " * 64
        tokens = tokenizer.encode(text)[:needed]
    with ShardModel(first.path, n_threads=args.threads) as first_model, first_model.new_context(n_ctx) as context:
        hidden = context.append(0, tokens=np.asarray(tokens))

    results: dict[str, dict[str, list[float]]] = {
        name: {"decode": [], "prefill": []} for name in ("baseline", "all-rows", "kvpool")
    }
    with ShardModel(middle.path, n_threads=args.threads) as model:
        variants = {
            "baseline": PlainContext(model, n_ctx, 512),
            "all-rows": PlainContext(model, n_ctx, 512, every_row=True),
            "kvpool": CaptureContext(model, n_ctx, 512),
        }
        try:
            for variant in variants.values():  # warm-up: first runs allocate buffers
                measure_prefill(variant, hidden, args.prefill)
                measure_decode(variant, hidden, args.history, 4)
            for round_index in range(args.rounds):
                order = list(variants.items()) if round_index % 2 == 0 else list(reversed(variants.items()))
                for name, variant in order:
                    results[name]["decode"].append(measure_decode(variant, hidden, args.history, args.decode_steps))
                    results[name]["prefill"].append(measure_prefill(variant, hidden, args.prefill))
                print(f"# round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for variant in variants.values():
                variant.close()

    medians = {name: {kind: statistics.median(values) for kind, values in kinds.items()} for name, kinds in results.items()}
    decode_ratio = medians["kvpool"]["decode"] / medians["baseline"]["decode"]
    prefill_ratio = medians["kvpool"]["prefill"] / medians["baseline"]["prefill"]
    print(f"middle shard {middle.shape}: {middle.path.name}")
    print(f"llama-cpp-python {llama_cpp.__version__}, {args.threads} thread(s), {args.rounds} interleaved rounds")
    all_rows_ratio = medians["all-rows"]["prefill"] / medians["baseline"]["prefill"]
    print()
    print(
        "| what | baseline: llama.cpp, no capture, last row | llama.cpp, no capture, every row output "
        "| kvpool: capture every row | ratio (kvpool / baseline) | target |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| decode, ms per token (median of {args.decode_steps} steps after {args.history} rows) "
        f"| {medians['baseline']['decode'] * 1e3:.3f} | {medians['all-rows']['decode'] * 1e3:.3f} "
        f"| {medians['kvpool']['decode'] * 1e3:.3f} "
        f"| {decode_ratio:.3f} | <= {DECODE_TARGET:.2f}: {'met' if decode_ratio <= DECODE_TARGET else 'MISSED'} |"
    )
    print(
        f"| prefill {args.prefill} rows, ms | {medians['baseline']['prefill'] * 1e3:.1f} "
        f"| {medians['all-rows']['prefill'] * 1e3:.1f} ({all_rows_ratio:.3f}x) "
        f"| {medians['kvpool']['prefill'] * 1e3:.1f} | {prefill_ratio:.3f} "
        f"| <= {PREFILL_TARGET:.2f}: {'met' if prefill_ratio <= PREFILL_TARGET else 'MISSED'} |"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "shard": str(middle.path),
                    "shard_sha256": file_sha256(middle.path),
                    "source_sha256": middle.source_sha256,
                    "llama_cpp_python": llama_cpp.__version__,
                    "system_info": llama_cpp.llama_print_system_info().decode(),
                    "machine": platform.machine(),
                    "threads": args.threads,
                    "raw_seconds": results,
                    "medians_seconds": medians,
                    "ratios": {"decode": decode_ratio, "prefill": prefill_ratio, "prefill_every_row_no_capture": all_rows_ratio},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

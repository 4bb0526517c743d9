"""Probe: four sessions decoding on one thread, one context each against one batched context (whole model).

(i)  four ShardContexts in this process, interleaved one row each (the process-mode schedule without IPC);
(ii) one BatchedShardContext with four sequences, one 4-row llama_decode per step.
Prints tok/s of each (median over alternating rounds), their ratio, whether the greedy tokens agree, and
the CPU model. The machines are shared and noisy: compare the ratio within one run.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvpool.local.tokenizer import Tokenizer  # noqa: E402
from kvpool.shard.bundled import bundled_model_path  # noqa: E402
from workers.runtime.batched import BatchedShardContext, SeqAppend  # noqa: E402
from workers.runtime.model import ShardModel  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
)


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def separate(model: ShardModel, prompts: list[list[int]], n_ctx: int, steps: int) -> tuple[float, list[list[int]], list[np.ndarray]]:
    contexts = [model.new_context(n_ctx) for _ in prompts]
    seen: list[np.ndarray] = []  # every session's logits row, step by step (compared after the timing)
    try:
        tokens = [[int(context.append(0, tokens=np.asarray(p))[-1].argmax())] for context, p in zip(contexts, prompts)]
        started = time.perf_counter()
        for step in range(steps):
            for context, prompt, generated in zip(contexts, prompts, tokens):
                logits = context.append(len(prompt) + step, tokens=np.asarray(generated[-1:]))
                generated.append(int(logits[-1].argmax()))
                seen.append(logits[-1])
        elapsed = time.perf_counter() - started
    finally:
        for context in contexts:
            context.close()
    return steps * len(prompts) / elapsed, tokens, seen


def batched(model: ShardModel, prompts: list[list[int]], n_ctx: int, steps: int) -> tuple[float, list[list[int]], list[np.ndarray]]:
    seen: list[np.ndarray] = []
    with BatchedShardContext(model, n_ctx, len(prompts), n_batch=512) as context:
        first = context.append_many([SeqAppend(seq, 0, np.asarray(p)) for seq, p in enumerate(prompts)])
        tokens = [[int(rows[-1].argmax())] for rows in first]
        started = time.perf_counter()
        for step in range(steps):
            rows = context.append_many([
                SeqAppend(seq, len(prompt) + step, np.asarray(generated[-1:]))
                for seq, (prompt, generated) in enumerate(zip(prompts, tokens))
            ])
            for generated, logits in zip(tokens, rows):
                generated.append(int(logits[-1].argmax()))
                seen.append(logits[-1])
        elapsed = time.perf_counter() - started
    return steps * len(prompts) / elapsed, tokens, seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per session per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of (i) and (ii)")
    args = parser.parse_args()
    path = bundled_model_path()
    with Tokenizer(path) as tokenizer:
        prompts = [tokenizer.encode(tokenizer.chat_prompt(text)) for text in PROMPTS]
    n_ctx = max(len(p) for p in prompts) + args.tokens + 1
    figures: dict[str, list[float]] = {"separate": [], "batched": []}
    agree = True
    largest_difference = 0.0
    agreeing_steps = total_steps = 0
    with ShardModel(path, n_threads=1) as model:
        separate(model, prompts, n_ctx, 2)  # warm-up: page in the weights
        for _ in range(args.rounds):
            rate, separate_tokens, separate_rows = separate(model, prompts, n_ctx, args.tokens)
            figures["separate"].append(rate)
            rate, batched_tokens, batched_rows = batched(model, prompts, n_ctx, args.tokens)
            figures["batched"].append(rate)
            agree = agree and separate_tokens == batched_tokens
            for one, other in zip(separate_tokens, batched_tokens):
                total_steps += len(one)
                agreeing_steps += next((index for index, (a, b) in enumerate(zip(one, other)) if a != b), len(one))
            if separate_tokens == batched_tokens:  # same tokens fed: the rows are comparable one to one
                largest_difference = max(largest_difference, max(float(np.abs(a - b).max()) for a, b in zip(separate_rows, batched_rows)))
    separate_rate = statistics.median(figures["separate"])
    batched_rate = statistics.median(figures["batched"])
    print(f"CPU: {cpu_model()}; whole bundled model, 1 thread, 4 sessions x {args.tokens} tokens, "
          f"median of {args.rounds} rounds")
    print("| schedule | tok/s (aggregate) | rounds |")
    print("|---|---|---|")
    print(f"| (i) 4 ShardContexts, interleaved one row each | {separate_rate:.1f} | "
          f"{', '.join(f'{r:.1f}' for r in figures['separate'])} |")
    print(f"| (ii) 1 BatchedShardContext, 4 rows per llama_decode | {batched_rate:.1f} | "
          f"{', '.join(f'{r:.1f}' for r in figures['batched'])} |")
    print(f"batched / separate: {batched_rate / separate_rate:.2f}x; greedy tokens identical: {agree} "
          f"({agreeing_steps} of {total_steps} greedy tokens agree before any divergence); "
          f"largest logit |difference| over every step of every session: {largest_difference!r}"
          + ("" if agree else " (rounds whose tokens diverged left out)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

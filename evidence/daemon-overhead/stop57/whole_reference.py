"""Is the whole model in one llama.cpp context the best llama.cpp does here? In one fresh process: the whole
model (ShardModel, its load collapsed into huge pages as the bench's references are) decoding through
kvpool.bench.reference.PlainContext (the bench's section-2 reference) and through the worker runtime's
ShardContext, against the same model's three shards in one process, each its own ShardContext, the hidden rows
handed on (section 2's LocalChain).
Turns of 3 timed steps (each turn's first step timed apart), as the bench takes them; 1 llama thread.

    PYTHONPATH=. python whole_reference.py WHOLE.gguf SHARD0 SHARD1 SHARD2
"""
import pathlib
import statistics
import sys
import time

import numpy as np

from kvpool.bench.reference import PlainContext
from workers.runtime.model import ShardModel

N_CTX, HISTORY, TURNS, TURN_STEPS = 512, 16, 30, 3
whole_path, *shard_paths = (pathlib.Path(arg) for arg in sys.argv[1:5])
whole = ShardModel(whole_path, n_threads=1)
shards = [ShardModel(path, n_threads=1) for path in shard_paths]
print(f"whole model's load: {whole.huge_pages.describe()}")
for index, shard in enumerate(shards):
    print(f"shard {index}'s load: {shard.huge_pages.describe()}")
whole_plain = PlainContext(whole, N_CTX, n_threads=1)
whole_runtime = whole.new_context(N_CTX)
chain = [shard.new_context(N_CTX) for shard in shards]
tokens = np.random.default_rng(0).integers(0, whole.shape.n_vocab, HISTORY + TURNS * (TURN_STEPS + 1) + 1).astype(np.int32)


def chain_step(position: int) -> None:
    rows = chain[0].append(position, tokens=tokens[position : position + 1])
    for context in chain[1:]:
        rows = context.append(position, hidden=rows)


variants = {
    "whole (PlainContext)": lambda position: whole_plain.append(position, tokens[position : position + 1]),
    "whole (runtime)": lambda position: whole_runtime.append(position, tokens=tokens[position : position + 1]),
    "3 shards (runtime)": chain_step,
}
for step in variants.values():  # the history
    for position in range(HISTORY):
        step(position)
times = {name: [] for name in variants}
cold = {name: [] for name in variants}
position = HISTORY
for turn in range(TURNS):
    for name in (list(variants) if turn % 2 == 0 else list(reversed(list(variants)))):
        for turn_step in range(TURN_STEPS + 1):
            started = time.perf_counter()
            variants[name](position + turn_step)
            (cold if turn_step == 0 else times)[name].append(time.perf_counter() - started)
    position += TURN_STEPS + 1
chain_ms = statistics.median(times["3 shards (runtime)"]) * 1e3
for name in variants:
    ms = statistics.median(times[name]) * 1e3
    print(f"  {name}: {ms:.2f} ms a token (median of {len(times[name])} steps; min {min(times[name]) * 1e3:.2f}, max {max(times[name]) * 1e3:.2f}), "
          f"{chain_ms / ms:.3f}x the 3 shards' speed; first steps of turns {statistics.median(cold[name]) * 1e3:.2f} ms")

"""Stop 54 variant of stop 53's idle_probe.py: is the slower step after a sleep the thread's migration to the other
CPU (pinned to one CPU: no migration) or the CPU's idling? Does a shard's llama_decode slow down when its thread idles between steps, as a route's worker does while the
other shards compute? The three shard contexts in this one process (1 llama thread), each one-token step timed
around each shard's append only, in three ways taking turns of 5 steps (each turn's first left out): back to back
(the shards one after another, as one process computes the whole model); asleep (the thread sleeps 40 ms before
each shard's append: its CPU idles, as a worker's does); spinning (the thread spins 40 ms instead: the CPU kept busy).
Usage: idle_probe.py MODEL ROUNDS"""
import pathlib, statistics, sys, time
sys.path.insert(0, "/work/main")
import numpy as np
from workers.runtime.model import ShardModel
from kvpool.shard.cache import shards_in_parts

model_path = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2])
shards = shards_in_parts(model_path, 3, progress=lambda line: None)
models = [ShardModel(s.path, n_threads=1) for s in shards]
PROMPT = np.arange(200, 328, dtype=np.int32)
ways = ("back to back", "asleep", "pinned back to back", "pinned asleep")
contexts = {}
for way in ways:
    cs = [m.new_context(1024) for m in models]
    rows = PROMPT
    for c in cs:
        rows = c.append(0, tokens=rows, output_rows="all") if c.shape.is_first else c.append(0, hidden=rows, output_rows="all" if not c.shape.is_last else "last")
    contexts[way] = cs


import os
ALL = os.sched_getaffinity(0)


def pause(way):
    os.sched_setaffinity(0, {min(ALL)} if way.startswith("pinned") else ALL)
    if way.endswith("asleep"):
        time.sleep(0.04)


spent = {way: [[], [], []] for way in ways}
pos = {way: len(PROMPT) for way in ways}
for r in range(rounds):
    for way in ways:
        for i in range(5):
            rows = np.array([1000 + r * 5 + i], dtype=np.int32)
            for k, c in enumerate(contexts[way]):
                pause(way)
                began = time.perf_counter()
                rows = c.append(pos[way], tokens=rows) if k == 0 else c.append(pos[way], hidden=rows)
                if i:
                    spent[way][k].append(time.perf_counter() - began)
            pos[way] += 1
    if pos[ways[0]] > 1000:
        break
base = None
for way in ways:
    meds = [statistics.median(v) * 1e3 for v in spent[way]]
    total = sum(meds)
    base = base or total
    print(f"{way:13s} append med by shard {meds[0]:.3f} {meds[1]:.3f} {meds[2]:.3f} ms, sum {total:.3f} ({total / base:.4f} of back to back)  steps {len(spent[way][0])}")

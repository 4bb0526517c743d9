"""Context creation, restore and save costs of the bundled middle shard at n_ctx 2112 holding 1056 positions."""
import sys, time, statistics
sys.path.insert(0, sys.argv[1])
import numpy as np
from workers.runtime.model import ShardModel
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda line: None)
model = ShardModel(shards[1].path, n_threads=1)
rng = np.random.default_rng(0)
hidden = rng.standard_normal((1056, model.shape.n_embd)).astype(np.float32)
src = model.new_context(2112)
src.append(0, hidden=hidden)
blob = src.save_state()
print("state bytes", len(blob))
T = {k: [] for k in ("create", "restore", "save", "close", "create+restore (fresh)", "clear+restore (spare)")}
for i in range(8):
    t0 = time.perf_counter(); c = model.new_context(2112); t1 = time.perf_counter()
    c.restore_state(blob, 1024); t2 = time.perf_counter()
    c.append(1024, hidden=hidden[:32]); t3 = time.perf_counter()
    b = c.save_state(); t4 = time.perf_counter()
    c.clear(data=True); t5 = time.perf_counter()
    c.restore_state(blob, 1024); t6 = time.perf_counter()
    c.close(); t7 = time.perf_counter()
    T["create"].append(t1 - t0); T["restore"].append(t2 - t1); T["save"].append(t4 - t3); T["close"].append(t7 - t6)
    T["create+restore (fresh)"].append(t2 - t0); T["clear+restore (spare)"].append(t6 - t4)
for k, v in T.items():
    print(f"{k:24s} med {statistics.median(v)*1e3:7.2f} ms  min {min(v)*1e3:7.2f}  max {max(v)*1e3:7.2f}")

import sys, pathlib, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np, llama_cpp
from workers.runtime.model import ShardModel
from kvpool.bench.reference import PlainContext
from kvpool.shard.cache import shards_in_parts
M = pathlib.Path(sys.argv[1]); N = int(sys.argv[2])
shards = shards_in_parts(M, 3, progress=lambda line: None)
def reused(ctx):
    d = llama_cpp.llama_perf_context(ctx); return d.n_reused, d.n_eval, d.n_p_eval
whole = ShardModel(M, n_threads=1); pc = PlainContext(whole, 1024, n_threads=1)
pc.append(0, np.arange(200, 328, dtype=np.int32))
t=[]
for i in range(N):
    s=time.perf_counter(); pc.append(128+i, np.array([1000+i], dtype=np.int32)); t.append(time.perf_counter()-s)
print("whole reuse", reused(pc.ctx), "med ms", statistics.median(t)*1e3)
models = [ShardModel(s.path, n_threads=1) for s in shards]
ctxs = [m.new_context(1024) for m in models]
rows = np.arange(200, 328, dtype=np.int32)
for c in ctxs: rows = c.append(0, tokens=rows) if c.shape.is_first else c.append(0, hidden=rows)
ts=[[] for _ in ctxs]
for i in range(N):
    r = np.array([1000+i], dtype=np.int32)
    for k,c in enumerate(ctxs):
        s=time.perf_counter(); r = c.append(128+i, tokens=r) if c.shape.is_first else c.append(128+i, hidden=r); ts[k].append(time.perf_counter()-s)
for k,c in enumerate(ctxs):
    print("shard", k, "reuse", reused(c._handle()), "med ms", statistics.median(ts[k])*1e3)

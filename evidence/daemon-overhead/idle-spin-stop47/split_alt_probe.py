import sys, pathlib, time, statistics, ctypes
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np, llama_cpp
from workers.runtime.model import ShardModel
from kvpool.bench.reference import PlainContext
from kvpool.shard.cache import shards_in_parts
M = pathlib.Path(sys.argv[1]); R = int(sys.argv[2])
shards = shards_in_parts(M, 3, progress=lambda line: None)
whole = ShardModel(M, n_threads=1); pc = PlainContext(whole, 1024, n_threads=1)
pc.append(0, np.arange(200, 328, dtype=np.int32))
models = [ShardModel(s.path, n_threads=1) for s in shards]
ctxs = [m.new_context(1024) for m in models]
rows = np.arange(200, 328, dtype=np.int32)
for c in ctxs: rows = c.append(0, tokens=rows) if c.shape.is_first else c.append(0, hidden=rows)
# raw decode timing via wrapping llama_decode
orig = llama_cpp.llama_decode
D = []
def timed(ctx, batch):
    s = time.perf_counter(); r = orig(ctx, batch); D.append(time.perf_counter() - s); return r
llama_cpp.llama_decode = timed
W=[]; C=[]; CD=[[],[],[]]; WD=[]
pw = pc_pos = 128; cp = 128
for r in range(R):
    for i in range(5):
        D.clear(); s=time.perf_counter(); pc.append(pw, np.array([1000+i], dtype=np.int32)); e=time.perf_counter(); pw+=1
        if i: W.append(e-s); WD.append(D[0])
    for i in range(5):
        D.clear(); s=time.perf_counter(); x = np.array([1000+i], dtype=np.int32)
        for k,c in enumerate(ctxs): x = c.append(cp, tokens=x) if c.shape.is_first else c.append(cp, hidden=x)
        e=time.perf_counter(); cp+=1
        if i:
            C.append(e-s)
            for k in range(3): CD[k].append(D[k])
    if pw > 900: break
m = lambda v: statistics.median(v)*1e3
print(f"whole {m(W):.3f} (decode {m(WD):.3f})  chain {m(C):.3f} (decodes {m(CD[0]):.3f} {m(CD[1]):.3f} {m(CD[2]):.3f} sum {m(CD[0])+m(CD[1])+m(CD[2]):.3f})  chain/whole {m(C)/m(W):.4f}")

"""A park's save in process, piece by piece: the size, the memfd, its pages (MAP_POPULATE), llama.cpp's write, the unmap."""
import ctypes, mmap, os, statistics, sys, time, pathlib
import numpy as np, llama_cpp
from kvpool.shard.cache import cached_shards
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.ranges import parse_splits
from kvpool.state.shared import new_memfd
from workers.runtime.model import ShardModel
shards = cached_shards(bundled_model_path(), parse_splits("0:10,10:20,20:30", 30), root=pathlib.Path(".kvpool/profile-shards"))
mid = shards[1]; N_CTX=2112; L=512
rows = (np.random.default_rng(0).standard_normal((L, mid.shape.n_embd)) * 0.1).astype(np.float32)
t = {k: [] for k in ("get_size","memfd+trunc","mmap_populate","get_data","munmap","close_fd","total")}
with ShardModel(mid.path) as model:
    ctx = model.new_context(N_CTX); ctx.append(0, hidden=rows)
    h = ctx._handle()
    for r in range(15):
        a=time.perf_counter(); size = llama_cpp.llama_state_seq_get_size(h, 0); b=time.perf_counter(); t["get_size"].append(b-a)
        fd = new_memfd(); os.ftruncate(fd, size + 8192); c=time.perf_counter(); t["memfd+trunc"].append(c-b)
        m = mmap.mmap(fd, size+8192, flags=mmap.MAP_SHARED|mmap.MAP_POPULATE); d=time.perf_counter(); t["mmap_populate"].append(d-c)
        w = (ctypes.c_uint8*size).from_buffer(m, 4096); n = llama_cpp.llama_state_seq_get_data(h, w, size, 0); del w; e=time.perf_counter(); t["get_data"].append(e-d)
        m.close(); f=time.perf_counter(); t["munmap"].append(f-e)
        os.close(fd); g=time.perf_counter(); t["close_fd"].append(g-f); t["total"].append(g-a)
    ctx.close()
for k,v in t.items(): print(f"{k:14s} med {statistics.median(v)*1e3:.3f} min {min(v)*1e3:.3f} ms")

import ctypes, mmap, os, statistics, sys, time, pathlib
import numpy as np, llama_cpp
from kvpool.shard.cache import cached_shards
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.ranges import parse_splits
from kvpool.state.shared import new_memfd
from workers.runtime.model import ShardModel
shards = cached_shards(bundled_model_path(), parse_splits("0:10,10:20,20:30", 30), root=pathlib.Path(".kvpool/profile-shards"))
mid = shards[1]; N_CTX=2112; L=512
rows = (np.random.default_rng(0).standard_normal((L+40, mid.shape.n_embd)) * 0.1).astype(np.float32)
HEAD=4096
def A(h, size):
    fd = new_memfd(); os.ftruncate(fd, size + 8192)
    with mmap.mmap(fd, size+8192, flags=mmap.MAP_SHARED|mmap.MAP_POPULATE) as m:
        w = (ctypes.c_uint8*size).from_buffer(m, HEAD); n = llama_cpp.llama_state_seq_get_data(h, w, size, 0); del w
    return fd
keep = mmap.mmap(-1, 64<<20)
def B(h, size):
    fd = new_memfd(); os.ftruncate(fd, size + 8192)
    w = (ctypes.c_uint8*size).from_buffer(keep, 0); n = llama_cpp.llama_state_seq_get_data(h, w, size, 0); del w
    os.pwrite(fd, memoryview(keep)[:size], HEAD)
    return fd
def C(h, size):
    fd = new_memfd(); os.ftruncate(fd, size + 8192)
    m = mmap.mmap(-1, size); m.madvise(mmap.MADV_HUGEPAGE)
    w = (ctypes.c_uint8*size).from_buffer(m, 0); n = llama_cpp.llama_state_seq_get_data(h, w, size, 0); del w
    os.pwrite(fd, m, HEAD); m.close()
    return fd
def D(h, size):  # no populate: faults one by one
    fd = new_memfd(); os.ftruncate(fd, size + 8192)
    with mmap.mmap(fd, size+8192, flags=mmap.MAP_SHARED) as m:
        w = (ctypes.c_uint8*size).from_buffer(m, HEAD); n = llama_cpp.llama_state_seq_get_data(h, w, size, 0); del w
    return fd
res = {k: [] for k in "ABCD"}
with ShardModel(mid.path) as model:
    ctx = model.new_context(N_CTX); ctx.append(0, hidden=rows[:L])
    h = ctx._handle()
    ref = None
    for r in range(20):
        for k, f in (("A",A),("B",B),("C",C),("D",D)):
            ctx.append(L + 0, hidden=rows[L:L+1]); ctx.truncate(L)  # a decode between: cold caches as in a worker
            size = llama_cpp.llama_state_seq_get_size(h, 0)
            a = time.perf_counter(); fd = f(h, size); b = time.perf_counter()
            res[k].append(b - a)
            data = os.pread(fd, size, HEAD); os.close(fd)
            if ref is None: ref = data
            assert data == ref, k
for k, v in res.items(): print(f"{k} med {statistics.median(v)*1e3:.3f} min {min(v)*1e3:.3f} max {max(v)*1e3:.3f} ms  size {size/2**20:.2f} MiB")

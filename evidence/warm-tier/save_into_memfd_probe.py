import pathlib, statistics, time, os, mmap, ctypes
import numpy as np, llama_cpp
from kvpool.shard.cache import cached_shards
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.ranges import parse_splits
from workers.runtime.model import ShardModel
from workers.runtime.sequence_io import save_sequence, _BYTE_POINTER
from kvpool.state.shared import new_memfd
shards = cached_shards(bundled_model_path(), parse_splits("0:10,10:20,20:30", 30), root=pathlib.Path(".kvpool/profile-shards"))
mid = shards[1]
rows = (np.random.default_rng(0).standard_normal((514, mid.shape.n_embd)) * 0.1).astype(np.float32)
def ms(v): return f"med {statistics.median(v)*1e3:.2f} min {min(v)*1e3:.2f}"
R = {k: [] for k in ["save_bytes","memfd_write","clear_false","clear_true","save_into_map","map_populate","save_into_populated","get_size"]}
with ShardModel(mid.path) as model:
    ctx = model.new_context(2112)
    for r in range(9):
        ctx.clear(data=True)
        ctx.append(0, hidden=rows[:512])
        h = ctx._handle()
        s=time.perf_counter(); n = llama_cpp.llama_state_seq_get_size(h, 0); R["get_size"].append(time.perf_counter()-s)
        s=time.perf_counter(); b = ctx.save_state(); R["save_bytes"].append(time.perf_counter()-s)
        s=time.perf_counter(); fd = new_memfd(); os.ftruncate(fd, len(b)+100); os.pwrite(fd, b, 96); R["memfd_write"].append(time.perf_counter()-s); os.close(fd)
        # save straight into a populated shared mapping
        s=time.perf_counter(); fd = new_memfd(); os.ftruncate(fd, n+100); m = mmap.mmap(fd, n+100, flags=mmap.MAP_SHARED|mmap.MAP_POPULATE); R["map_populate"].append(time.perf_counter()-s)
        s2=time.perf_counter(); addr = ctypes.addressof(ctypes.c_char.from_buffer(m, 96)); w = llama_cpp.llama_state_seq_get_data(h, ctypes.cast(addr, _BYTE_POINTER), n, 0); R["save_into_populated"].append(time.perf_counter()-s2)
        R["save_into_map"].append(time.perf_counter()-s)
        assert w == n and m[96:96+n] == b
        import gc; gc.collect()
        try: m.close()
        except BufferError: pass
        os.close(fd)
        s=time.perf_counter(); ctx.clear(data=False); R["clear_false"].append(time.perf_counter()-s)
        s=time.perf_counter(); ctx.clear(data=True); R["clear_true"].append(time.perf_counter()-s)
for k,v in R.items(): print(f"{k:22s} {ms(v)}")

import ctypes, sys, time, statistics, pathlib, os
import numpy as np
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel
from workers.server.readings import huge_page_bytes
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
def anon_maps():
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) < 6 or parts[5] in ("[heap]", "[stack]", "[vvar]", "[vdso]") or (len(parts) >= 6 and parts[5]):
            if not (len(parts) == 5):
                continue
        a, b = (int(x, 16) for x in parts[0].split("-"))
        if "rw" in parts[1] and b - a >= 2 << 20:
            out.append((a, b))
    return out
shards = shards_in_parts(pathlib.Path(sys.argv[1]), 3, progress=lambda line: None)
before = set(anon_maps())
m = ShardModel(shards[1].path, n_threads=1)
new = [r for r in anon_maps() if r not in before]
print("new anon maps >= 2 MiB:", len(new), sum(b - a for a, b in new) >> 20, "MiB; huge before", huge_page_bytes() >> 20)
if sys.argv[2] == "collapse":
    t = time.perf_counter()
    for a, b in new:
        start = (a + (2 << 20) - 1) & ~((2 << 20) - 1); end = b & ~((2 << 20) - 1)
        if end <= start: continue
        r1 = libc.madvise(start, end - start, MADV_HUGEPAGE)
        r2 = libc.madvise(start, end - start, MADV_COLLAPSE)
        if r2: print("collapse errno", ctypes.get_errno())
    print(f"collapse took {(time.perf_counter()-t)*1e3:.0f} ms; huge after", huge_page_bytes() >> 20, "MiB")
ctx = m.new_context(1024)
rows = (np.random.default_rng(0).standard_normal((200, m.shape.n_embd)) * 0.1).astype(np.float32)
ctx.append(0, hidden=rows[:128])
ts = []
for i in range(40):
    s = time.perf_counter(); ctx.append(128, hidden=rows[128:129]); ts.append(time.perf_counter() - s); ctx.truncate(128)
print(sys.argv[2], f"step med {statistics.median(ts)*1e3:.2f} ms; huge at end {huge_page_bytes() >> 20} MiB")

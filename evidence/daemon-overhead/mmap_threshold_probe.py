import sys, time, statistics, resource
import numpy as np
from workers.server.main import fix_allocator
if sys.argv[2] == "fixed":
    print("fixed:", fix_allocator())
from workers.runtime.model import ShardModel
m = ShardModel(sys.argv[1], n_threads=1)
ctx = m.new_context(1024)
toks = np.arange(1, 129, dtype=np.int32)
ctx.append(0, tokens=toks)
ts = []
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for r in range(3):
    for i in range(30):
        s = time.perf_counter(); ctx.append(128 + i, tokens=np.array([5 + i], np.int32)); ts.append(time.perf_counter() - s)
    ctx.truncate(128)
f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(sys.argv[2], f"step med {statistics.median(ts)*1e3:.2f} min {min(ts)*1e3:.2f} ms; minor faults/step {(f1-f0)/90:.1f}; collapse {m.huge_pages.describe()}")

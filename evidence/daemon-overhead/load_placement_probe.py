"""The whole ~1B model's decode step (1 thread, 60 steps after a 128-token prompt, median) over `loads` loads in this
process, then printed; run several times: per load and per process."""
import sys, time, statistics, numpy as np, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from workers.runtime.model import ShardModel
model, loads = sys.argv[1], int(sys.argv[2])
out = []
for load in range(loads):
    with ShardModel(model, n_threads=1) as m, m.new_context(1024) as c:
        c.append(0, tokens=np.arange(200, 328, dtype=np.int32))
        t = []
        for p in range(128, 188):
            s = time.perf_counter(); c.append(p, tokens=np.asarray([p % 1000], np.int32)); t.append(time.perf_counter() - s)
        out.append(statistics.median(t[5:]) * 1e3)
print(f"pid {os.getpid()}: per-load medians (ms):", " ".join(f"{v:.2f}" for v in out))

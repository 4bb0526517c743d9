"""The whole ~1B model's decode step in one process at 1 and 2 llama threads, alternating (60 steps after a 128-token
prompt, median of the last 55). Usage: python threads_probe.py MODEL."""
import sys, time, statistics, numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from workers.runtime.model import ShardModel
model = sys.argv[1]
for n in (1, 2, 1, 2):
    with ShardModel(model, n_threads=n) as m, m.new_context(1024) as c:
        c.append(0, tokens=np.arange(200, 328, dtype=np.int32))
        t = []
        for p in range(128, 188):
            s = time.perf_counter(); c.append(p, tokens=np.asarray([p], np.int32)); t.append(time.perf_counter() - s)
        print(n, "threads: med ms", round(statistics.median(t[5:]) * 1e3, 2), "min", round(min(t) * 1e3, 2))

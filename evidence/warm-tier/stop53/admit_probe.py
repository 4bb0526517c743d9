"""Where a ~1B admission goes: a whole-model daemon as the bench's section 5 starts it (1 thread, --max-sessions 4),
admitting 1-token appends at an n_ctx then released, against the same in this process (create + 1-token append) and a
bare create, in turns. Usage: admit_probe.py MODEL N_CTX ROUNDS"""
import os, pathlib, statistics, sys, tempfile, time, contextlib
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
import numpy as np
from kvpool.launcher import Daemon
from kvpool.bench.reference import PlainContext
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); n_ctx = int(sys.argv[2]); rounds = int(sys.argv[3])
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "8192", "--max-sessions", "4", *sys.argv[4:]]
T = {"daemon admit": [], "daemon release": [], "daemon decode": [], "inproc create+append": [], "bare create": [], "inproc decode": []}
with contextlib.ExitStack() as stack:
    d = Daemon(model, pathlib.Path(tempfile.mkdtemp(prefix="kvpool-adm-")) / "w.sock", opts)
    stack.callback(d.stop); d.wait_ready()
    client = stack.enter_context(d.client())
    m = stack.enter_context(ShardModel(model, n_threads=1))
    for r in range(rounds):
        s = time.perf_counter(); client.append(f"a{r}", 1, 0, tokens=[200], n_ctx=n_ctx); T["daemon admit"].append(time.perf_counter() - s)
        for p in range(1, 4):
            s = time.perf_counter(); client.append(f"a{r}", 1, p, tokens=[200]); T["daemon decode"].append(time.perf_counter() - s)
        s = time.perf_counter(); client.release(f"a{r}", 1); T["daemon release"].append(time.perf_counter() - s)
        time.sleep(0.3)
        s = time.perf_counter(); c = m.new_context(n_ctx); c.append(0, tokens=np.array([200], dtype=np.int32)); T["inproc create+append"].append(time.perf_counter() - s)
        for p in range(1, 4):
            s = time.perf_counter(); c.append(p, tokens=np.array([200], dtype=np.int32)); T["inproc decode"].append(time.perf_counter() - s)
        c.close()
        s = time.perf_counter(); pc = PlainContext(m, n_ctx, n_threads=1); T["bare create"].append(time.perf_counter() - s); pc.close()
        time.sleep(0.3)
    for k, v in T.items():
        print(f"{k:22s} med {statistics.median(v)*1e3:8.2f} ms  min {min(v)*1e3:8.2f}  max {max(v)*1e3:8.2f}  n {len(v)}")
    print(client.stats().counters)

import os, pathlib, sys, tempfile, contextlib, subprocess
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel
import numpy as np
model = pathlib.Path(sys.argv[1])
shards = shards_in_parts(model, 3, progress=lambda line: None)
mid = shards[1]
def report(pid, label):
    cur = None; out = []
    for line in open(f"/proc/{pid}/smaps"):
        if not line[0].isupper() or line.split()[0].count("-") == 1 and ":" not in line.split()[0]:
            cur = line.strip(); continue
        if ".gguf" in (cur or "") and line.startswith(("Rss", "FilePmdMapped", "AnonHugePages")):
            out.append((cur.split()[0], cur.split()[-1][-30:], line.split()[0], line.split()[1]))
    roll = [l for l in open(f"/proc/{pid}/smaps_rollup") if l.startswith(("Rss", "AnonHugePages", "FilePmdMapped"))]
    print(label, pid, [l.split()[0] + l.split()[1] for l in roll])
    for o in out: print("   ", o)
with contextlib.ExitStack() as st:
    d = Daemon(mid.path, pathlib.Path(tempfile.mkdtemp()) / "m.sock", ["--ttl","600","--threads","1","--threads-per-worker","1","--n-ctx","1024","--max-sessions","1"])
    st.callback(d.stop); d.wait_ready()
    c = st.enter_context(d.client())
    rows = (np.random.default_rng(0).standard_normal((200, mid.shape.n_embd)) * 0.1).astype(np.float32)
    c.append("s", 1, 0, hidden=rows[:128])
    for pid in d.worker_pids(): report(pid, "worker")
    m = st.enter_context(ShardModel(mid.path, n_threads=1)); ctx = st.enter_context(m.new_context(1024)); ctx.append(0, hidden=rows[:128])
    report(os.getpid(), "inproc")

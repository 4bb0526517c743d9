import os, sys, pathlib, contextlib, time, statistics, tempfile
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1])
shards = shards_in_parts(model, 3, progress=lambda line: None)
src = shards[1].path; dst = pathlib.Path("/work/main/.kvpool/mid-small.gguf")
with open(src, "rb") as f, open(dst, "wb") as g:
    while b := f.read(64 << 10):
        g.write(b)
fd = os.open(src, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
rows = (np.random.default_rng(0).standard_normal((1024, shards[1].shape.n_embd)) * 0.1).astype(np.float32)
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1"]
with contextlib.ExitStack() as st:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-pmd-"))
    runs = {}
    for name, p in (("d-small", dst), ("d-huge", src)):
        d = Daemon(p, sockets / f"{name}.sock", opts); st.callback(d.stop); d.wait_ready()
        c = st.enter_context(d.client()); c.append("s", 1, 0, hidden=rows[:128])
        runs[name] = (lambda c: (lambda pos, x: c.append("s", 1, pos, hidden=x)))(c)
        tr = (lambda c: (lambda: c.truncate("s", 1, 128)))(c)
        runs[name] = (runs[name], tr)
    m = st.enter_context(ShardModel(src, n_threads=1)); cx = st.enter_context(m.new_context(1024)); cx.append(0, hidden=rows[:128])
    runs["inproc"] = ((lambda pos, x: cx.append(pos, hidden=x)), (lambda: cx.truncate(128)))
    T = {k: [] for k in runs}; pos = 128
    for r in range(int(sys.argv[2])):
        for name, (f, _) in runs.items():
            for s in range(5):
                t = time.perf_counter(); f(pos + s, rows[pos + s:pos + s + 1]); e = time.perf_counter()
                if s: T[name].append(e - t)
        pos += 5
        if pos > 1000:
            for _, tr in runs.values(): tr()
            pos = 128
    med = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    print({k: round(v, 3) for k, v in med.items()}, "ratios vs inproc:", {k: round(med["inproc"] / v, 3) for k, v in med.items()})

os.remove(dst)

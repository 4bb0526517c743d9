import os, sys, pathlib, contextlib, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1])
shards = shards_in_parts(model, 3, progress=lambda line: None)
src = shards[1].path
dst = pathlib.Path("/tmp/p49/mid-pmd.gguf")
CH = 2 << 20
if not dst.exists() or "--rewrite" in sys.argv:
    dst.unlink(missing_ok=True)
    with open(src, "rb") as f, open(dst, "wb") as g:
        while True:
            b = f.read(CH)
            if not b: break
            g.write(b)
def filepmd(path):
    cur = None; rss = pmd = 0
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" not in parts[0]:
            cur = parts[-1] if len(parts) >= 6 else ""
        elif cur and cur.endswith(path.name):
            if parts[0] == "Rss:": rss += int(parts[1])
            if parts[0] == "FilePmdMapped:": pmd += int(parts[1])
    return rss, pmd
rows = (np.random.default_rng(0).standard_normal((1024, shards[1].shape.n_embd)) * 0.1).astype(np.float32)
with contextlib.ExitStack() as st:
    ctxs = {}
    for name, p in (("orig", src), ("pmd", dst)):
        m = st.enter_context(ShardModel(p, n_threads=1)); c = st.enter_context(m.new_context(1024)); c.append(0, hidden=rows[:128])
        ctxs[name] = c
        print(name, "Rss/FilePmdMapped kB", filepmd(p))
    T = {k: [] for k in ctxs}; pos = 128
    for r in range(int(sys.argv[2])):
        for name, c in ctxs.items():
            for s in range(5):
                t = time.perf_counter(); c.append(pos + s, hidden=rows[pos + s:pos + s + 1]); e = time.perf_counter()
                if s: T[name].append(e - t)
        pos += 5
        if pos > 1000:
            for c in ctxs.values(): c.truncate(128)
            pos = 128
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in T.items()})

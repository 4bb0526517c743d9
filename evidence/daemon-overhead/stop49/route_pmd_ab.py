"""Page-cache folios A/B: two routes of the ~1B model's 3 shard daemons in one probe. Route "small": copies of the
shard files written with 64 KiB writes (their page cache in small folios, as the writes made them; kept cached).
Route "huge": the shard files dropped from the page cache first, so that the daemons' own reads (this tree:
read in 2 MiB folios) decide. The whole model in this process (1 thread) as reference; turns of 5 one-token
greedy steps (each turn's first left out), the three taking turns. Usage: route_pmd_ab.py MODEL ROUNDS"""
import os, pathlib, statistics, sys, tempfile, time, contextlib, shutil
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
from kvpool.bench.reference import PlainContext
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2])
shards = shards_in_parts(model, 3, progress=lambda line: None)
small_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-small-", dir="/work/main/.kvpool"))
small = []
for s in shards:
    dst = small_dir / s.path.name
    with open(s.path, "rb") as f, open(dst, "wb") as g:
        while b := f.read(64 << 10):
            g.write(b)
    small.append(dst)
for s in shards:
    fd = os.open(s.path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def file_pmd(pid, name):
    cur = None; rss = pmd = 0
    for line in open(f"/proc/{pid}/smaps"):
        p = line.split()
        if p and "-" in p[0] and not p[0].endswith(":"): cur = p[-1] if len(p) >= 6 else ""
        elif cur and cur.endswith(name):
            if p[0] == "Rss:": rss += int(p[1])
            if p[0] == "FilePmdMapped:": pmd += int(p[1])
    return rss // 1024, pmd // 1024
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1"]
with contextlib.ExitStack() as stack:
    stack.callback(shutil.rmtree, small_dir)
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-ab-"))
    routes = {}
    for name, paths in (("small", small), ("huge", [s.path for s in shards])):
        ds = [Daemon(p, sockets / f"{name}{i}.sock", opts) for i, p in enumerate(paths)]
        for d in ds: stack.callback(d.stop)
        for d in ds: d.wait_ready()
        clients = [stack.enter_context(d.client()) for d in ds]
        sess = Router(clients).session("p", epoch=1)
        sess.sample(list(range(200, 328)), Sampling())
        routes[name] = sess
        for d, p in zip(ds, paths):
            print(name, p.name, "worker file MiB (Rss, FilePmdMapped):", [file_pmd(w, p.name) for w in d.worker_pids()])
    whole = stack.enter_context(ShardModel(model, n_threads=1)); pc = PlainContext(whole, 1024, n_threads=1)
    pc.append(0, np.arange(200, 328, dtype=np.int32)); wpos = 128
    T = {"small": [], "huge": [], "whole": []}
    for r in range(rounds):
        for name in ("small", "huge", "whole"):
            for step in range(5):
                s = time.perf_counter()
                if name == "whole":
                    pc.append(wpos, np.array([1000 + step], dtype=np.int32)); wpos += 1
                else:
                    routes[name].sample([1000 + step], Sampling())
                e = time.perf_counter()
                if step: T[name].append(e - s)
        if wpos > 900:
            break
    m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    print(f"rounds {r+1}: whole {m['whole']:.3f} ms  route small folios {m['small']:.3f} ({m['whole']/m['small']:.3f})  route 2 MiB folios {m['huge']:.3f} ({m['whole']/m['huge']:.3f})")

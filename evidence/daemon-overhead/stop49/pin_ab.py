"""Pinning A/B: two routes of the ~1B model's 3 shard daemons in one probe, route A floating, route B with every
thread of its daemons (supervisors and workers) and the client's thread (during B's turns) on CPU 0; the whole model
in this process (1 thread, floating) as reference; turns of 5 one-token greedy steps (each turn's first left out),
A / B / whole taking turns. Usage: pin_ab.py MODEL ROUNDS"""
import os, pathlib, statistics, sys, tempfile, time, contextlib
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
ALL = os.sched_getaffinity(0)
def pin_tree(pid, cpus):
    todo = [pid]
    while todo:
        p = todo.pop()
        for tid in os.listdir(f"/proc/{p}/task"):
            os.sched_setaffinity(int(tid), cpus)
            try:
                todo += [int(c) for c in open(f"/proc/{p}/task/{tid}/children").read().split()]
            except FileNotFoundError:
                pass
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1"]
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-pin-"))
    routes = {}
    for name in ("A", "B"):
        ds = [Daemon(s.path, sockets / f"{name}{i}.sock", opts) for i, s in enumerate(shards)]
        for d in ds: stack.callback(d.stop)
        for d in ds: d.wait_ready()
        if name == "B":
            for d in ds: pin_tree(d.process.pid, {0})
        clients = [stack.enter_context(d.client()) for d in ds]
        sess = Router(clients).session("p", epoch=1)
        sess.sample(list(range(200, 328)), Sampling())
        routes[name] = sess
    whole = stack.enter_context(ShardModel(model, n_threads=1)); pc = PlainContext(whole, 1024, n_threads=1)
    pc.append(0, np.arange(200, 328, dtype=np.int32)); wpos = 128
    T = {"A": [], "B": [], "whole": []}
    tok = {"A": None, "B": None}
    for r in range(rounds):
        for name in ("A", "B", "whole"):
            os.sched_setaffinity(0, {0} if name == "B" else ALL)
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
    os.sched_setaffinity(0, ALL)
    m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    print(f"rounds {r+1}: whole {m['whole']:.3f}  route floating {m['A']:.3f} ({m['whole']/m['A']:.3f})  route pinned cpu0 {m['B']:.3f} ({m['whole']/m['B']:.3f})")

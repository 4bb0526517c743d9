"""Route placement probe: one route of the model's 3 shard daemons (1 llama thread a worker), its workers' and the
client's CPUs set turn by turn; the whole model and LocalChain in this process as references. Turns of 6 one-token
greedy steps (each turn's first left out). Usage: pin_probe.py MODEL ROUNDS"""
import os, pathlib, statistics, sys, tempfile, time, contextlib
sys.path.insert(0, os.getcwd())  # run from a checkout (stop 58 ran it with /work/main here)
import numpy as np
import psutil
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
from kvpool.bench.reference import PlainContext
from kvpool.local.chain import LocalChain
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2])
shards = shards_in_parts(model, 3, progress=lambda line: None)
ALL = os.sched_getaffinity(0)
def set_threads(pid, cpus):
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1"] + sys.argv[3:]
# variant: (workers' cpus, client's cpus)
VARIANTS = {"route floating": (ALL, ALL), "route all cpu0": ({0}, {0}), "route all cpu1": ({1}, {1}), "route workers cpu1, client cpu0": ({1}, {0}), "route workers cpu1, client floats": ({1}, ALL)}
REFS = {"whole floating": ALL, "local chain floating": ALL, "local chain cpu0": {0}, "local chain cpu1": {1}}
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-pin-"))
    ds = [Daemon(s.path, sockets / f"d{i}.sock", opts) for i, s in enumerate(shards)]
    for d in ds: stack.callback(d.stop)
    for d in ds: d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in ds]
    sess = Router(clients).session("p", epoch=1)
    sess.sample(list(range(200, 328)), Sampling())
    kids = [c for d in ds for c in psutil.Process(d.process.pid).children()]
    for c in kids: print(c.pid, c.cmdline()[-3:], flush=True)
    workers = [c.pid for c in kids if "spinner" not in " ".join(c.cmdline())]
    whole = stack.enter_context(ShardModel(model, n_threads=1)); pc = PlainContext(whole, 1024, n_threads=1)
    pc.append(0, np.arange(200, 328, dtype=np.int32)); wpos = 128
    chain = stack.enter_context(LocalChain([s.path for s in shards], n_threads=1)); cs = chain.new_session(1024)
    cs.append(0, list(range(200, 328))); cpos = 128
    names = list(VARIANTS) + list(REFS)
    T = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if name in VARIANTS:
                wc, cc = VARIANTS[name]
                for w in workers: set_threads(w, wc)
                os.sched_setaffinity(0, cc)
            else:
                for w in workers: set_threads(w, ALL)
                os.sched_setaffinity(0, REFS[name])
            for step in range(6):
                s = time.perf_counter()
                if name == "whole floating":
                    pc.append(wpos, np.array([1000 + step], dtype=np.int32)); wpos += 1
                elif name.startswith("local chain"):
                    cs.append(cpos, [1000 + step]); cpos += 1
                else:
                    sess.sample([1000 + step], Sampling())
                e = time.perf_counter()
                if step: T[name].append(e - s)
        if sess.length > 980 or wpos > 980:
            break
    os.sched_setaffinity(0, ALL)
    m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    ref = min(m["whole floating"], m["local chain floating"])
    print(f"rounds {r+1}, medians ms a token (speed against the faster reference {ref:.3f}):")
    for k in names:
        print(f"  {k:32s} {m[k]:8.3f}  {ref / m[k]:.3f}")

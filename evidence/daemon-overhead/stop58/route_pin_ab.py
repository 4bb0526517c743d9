"""--pin-sessions A/B: two routes of the model's 3 shard daemons (1 llama thread a worker, --keep-warm as given),
route "off" with --pin-sessions off and route "auto" with --pin-sessions auto, the client floating; LocalChain and
the whole model in this process (1 thread, floating) as references; turns of 6 one-token greedy steps (each turn's
first left out), in alternating order. Usage: route_pin_ab.py MODEL ROUNDS [serve options...]"""
import os, pathlib, statistics, sys, tempfile, time, contextlib
sys.path.insert(0, os.getcwd())
import numpy as np
import psutil
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
from kvpool.bench.reference import PlainContext
from kvpool.local.chain import LocalChain
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]); extra = sys.argv[3:]
shards = shards_in_parts(model, 3, progress=lambda line: None)
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "2048", "--max-sessions", "1"] + extra
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-pinab-"))
    routes = {}
    for name in ("off", "auto"):
        ds = [Daemon(s.path, sockets / f"{name}{i}.sock", opts + ["--pin-sessions", name]) for i, s in enumerate(shards)]
        for d in ds: stack.callback(d.stop)
        for d in ds: d.wait_ready()
        clients = [stack.enter_context(d.client()) for d in ds]
        sess = Router(clients).session(f"pin-{name}", epoch=1)
        sess.sample(list(range(200, 328)), Sampling())
        routes[name] = sess
        for d, c in zip(ds, clients):
            print(name, c.stats().placement, flush=True)
            if name == "auto":
                CLIENT_CPUS = set(psutil.Process(d.process.pid).children()[-1].cpu_affinity())
            for kid in psutil.Process(d.process.pid).children():
                print("  ", kid.pid, sorted(kid.cpu_affinity()), " ".join(kid.cmdline()[-2:])[:60], flush=True)
    whole = stack.enter_context(ShardModel(model, n_threads=1)); pc = PlainContext(whole, 2048, n_threads=1)
    pc.append(0, np.arange(200, 328, dtype=np.int32)); wpos = 128
    chain = stack.enter_context(LocalChain([s.path for s in shards], n_threads=1)); cs = chain.new_session(2048)
    cs.append(0, list(range(200, 328))); cpos = 128
    names = ["route off", "route auto", "route auto+client", "whole", "local chain"]
    ALL = os.sched_getaffinity(0)
    T = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for step in range(6):
                s = time.perf_counter()
                if name == "whole":
                    pc.append(wpos, np.array([1000 + step], dtype=np.int32)); wpos += 1
                elif name == "local chain":
                    cs.append(cpos, [1000 + step]); cpos += 1
                elif name == "route auto+client":
                    os.sched_setaffinity(0, CLIENT_CPUS)
                    routes["auto"].sample([1000 + step], Sampling())
                    os.sched_setaffinity(0, ALL)
                else:
                    routes[name.split()[1]].sample([1000 + step], Sampling())
                e = time.perf_counter()
                if step: T[name].append(e - s)
        if wpos > 2000:
            break
    m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    ref = min(m["whole"], m["local chain"])
    print(f"rounds {r+1}, medians ms a token (speed against the faster reference, {ref:.3f} ms):")
    for k in names:
        print(f"  {k:14s} {m[k]:8.3f}  {ref / m[k]:.3f}")

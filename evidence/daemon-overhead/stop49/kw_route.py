"""The ~1B model's 3 shard daemons (extra daemon options from argv[3:]) as a Router route sampling greedy, against
the whole model in this process (1 thread), in turns of 5 one-token steps (each turn's first left out).
Usage: kw_route.py MODEL ROUNDS [daemon options]"""
import os, pathlib, statistics, sys, tempfile, time, contextlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
from kvpool.bench.reference import PlainContext
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]); extra = sys.argv[3:]
shards = shards_in_parts(model, 3, progress=lambda line: None)
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1", *extra]
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-kw-"))
    ds = [Daemon(s.path, sockets / f"s{i}.sock", opts) for i, s in enumerate(shards)]
    for d in ds: stack.callback(d.stop)
    for d in ds: d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in ds]
    sess = Router(clients).session("p", epoch=1)
    sess.sample(list(range(200, 328)), Sampling())
    whole = stack.enter_context(ShardModel(model, n_threads=1)); pc = PlainContext(whole, 1024, n_threads=1)
    pc.append(0, np.arange(200, 328, dtype=np.int32)); wpos = 128
    T = {"route": [], "whole": []}
    for r in range(rounds):
        for name in ("route", "whole"):
            for step in range(5):
                s = time.perf_counter()
                if name == "whole":
                    pc.append(wpos, np.array([1000 + step], dtype=np.int32)); wpos += 1
                else:
                    sess.sample([1000 + step], Sampling())
                e = time.perf_counter()
                if step: T[name].append(e - s)
        if wpos > 900:
            break
    m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    print(f"{' '.join(extra) or 'defaults'}: rounds {r+1}: whole {m['whole']:.3f} ms  route {m['route']:.3f} ms  route/whole speed {m['whole']/m['route']:.3f}")

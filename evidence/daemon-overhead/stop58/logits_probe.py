"""The whole model through one daemon (1 llama thread, direct channel): one-token appends whose reply carries the
logits row against appends sampled greedy in the worker (a token id back), and the whole model in this process, in
turns of 8 steps (each turn's first left out), alternating order. Run from a checkout (its code, client and daemon).
Usage: logits_probe.py MODEL ROUNDS"""
import os, pathlib, statistics, sys, tempfile, time, contextlib
sys.path.insert(0, os.getcwd())
import numpy as np
from kvpool.launcher import Daemon
from kvpool.wire.sampling import Sampling
from kvpool.bench.reference import PlainContext
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2])
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "2048", "--max-sessions", "2"]
with contextlib.ExitStack() as stack:
    d = Daemon(model, pathlib.Path(tempfile.mkdtemp(prefix="kvpool-lg-")) / "w.sock", opts)
    stack.callback(d.stop); d.wait_ready()
    c = stack.enter_context(d.client())
    pos = {"logits": 0, "sampled": 0}
    for s in pos:
        c.append(s, 1, 0, tokens=list(range(200, 264)), n_ctx=2048); pos[s] = 64
    whole = stack.enter_context(ShardModel(model, n_threads=1)); pc = PlainContext(whole, 2048, n_threads=1)
    pc.append(0, np.arange(200, 264, dtype=np.int32)); wpos = 64
    names = ["logits", "sampled", "in process"]
    T = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for step in range(8):
                s = time.perf_counter()
                if name == "in process":
                    pc.append(wpos, np.array([1000 + step], dtype=np.int32)); wpos += 1
                elif name == "logits":
                    rows = c.append(name, 1, pos[name], tokens=[1000 + step]).rows; pos[name] += 1
                else:
                    c.append(name, 1, pos[name], tokens=[1000 + step], sample=Sampling()); pos[name] += 1
                e = time.perf_counter()
                if step: T[name].append(e - s)
        if wpos > 2000:
            break
    m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    print(f"{os.getcwd()} rounds {r+1}, logits {rows.shape} {rows.dtype}; medians ms a token: " + ", ".join(f"{k} {m[k]:.3f}" for k in names)
          + f"; logits - sampled {m['logits'] - m['sampled']:.3f}; in process / logits {m['in process'] / m['logits']:.3f}, / sampled {m['in process'] / m['sampled']:.3f}")

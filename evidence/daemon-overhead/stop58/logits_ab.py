"""Logits replies, old worker against new: two daemons of the whole model (1 llama thread, direct channel), one
started from checkout OLD and one from NEW (each runs its own code: supervisor and workers), one client (this
process, NEW's code). Variants in turns of 8 one-token steps (each turn's first left out), order alternating:
old/new x logits/sampled. Also each worker's minor faults per step.
Usage: logits_ab.py MODEL ROUNDS OLD NEW"""
import os, pathlib, statistics, sys, tempfile, time, contextlib
model = pathlib.Path(sys.argv[1]).resolve(); rounds = int(sys.argv[2]); trees = {"old": sys.argv[3], "new": sys.argv[4]}
sys.path.insert(0, trees["new"])
import psutil
from kvpool.launcher import Daemon
from kvpool.wire.sampling import Sampling
def minflt(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "2048", "--max-sessions", "2"]
tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-lab-"))
with contextlib.ExitStack() as stack:
    clients, workers, pos = {}, {}, {}
    for name, tree in trees.items():
        os.chdir(tree)
        d = Daemon(model, tmp / f"{name}.sock", opts); stack.callback(d.stop); d.wait_ready()
        c = stack.enter_context(d.client()); clients[name] = c
        for kind in ("logits", "sampled"):
            c.append(kind, 1, 0, tokens=list(range(200, 264)), n_ctx=2048); pos[(name, kind)] = 64
        workers[name] = [k.pid for k in psutil.Process(d.process.pid).children() if "spawn_main" in " ".join(k.cmdline())]
    names = [(t, k) for t in trees for k in ("logits", "sampled")]
    T = {n: [] for n in names}; F = {n: [0, 0] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            tree, kind = name; c = clients[tree]
            f0 = sum(minflt(p) for p in workers[tree])
            for step in range(8):
                s = time.perf_counter()
                c.append(kind, 1, pos[name], tokens=[1000 + step], sample=Sampling() if kind == "sampled" else None); pos[name] += 1
                e = time.perf_counter()
                if step: T[name].append(e - s)
            F[name][0] += sum(minflt(p) for p in workers[tree]) - f0; F[name][1] += 8
        if max(pos.values()) > 2000:
            break
    m = {n: statistics.median(v) * 1e3 for n, v in T.items()}
    print(f"rounds {r + 1}, medians ms a token (worker minor faults a step):")
    for n in names:
        print(f"  {n[0]} worker, {n[1]:8s} {m[n]:8.3f}  ({F[n][0] / F[n][1]:.1f})")
    for t in trees:
        print(f"  {t} worker: logits - sampled {m[(t, 'logits')] - m[(t, 'sampled')]:.3f} ms")

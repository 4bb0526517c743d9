"""Four sessions through two --mode batched whole-model daemons, one running each checkout's code, in turns:
tokens/s and the worker's minor page faults a token."""
import os, sys, time, threading, pathlib, tempfile, statistics
import psutil
checkouts = sys.argv[1:3]
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 48
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 7
MODEL = sys.argv[5] if len(sys.argv) > 5 else None
sys.path.insert(0, checkouts[0])
from kvpool.launcher import Daemon
from kvpool.client.client import Client
from kvpool.shard.bundled import bundled_model_path
from kvpool.wire.sampling import Sampling
model = pathlib.Path(MODEL) if MODEL else bundled_model_path()
tmp = pathlib.Path(tempfile.mkdtemp())
daemons, clients = {}, {}
for index, checkout in enumerate(checkouts):
    os.chdir(checkout)
    d = Daemon(model, tmp / f"d{index}.sock", ["--ttl", "600", "--keep-warm", "1", "--n-ctx", "1024", "--mode", "batched", "--seqs-per-worker", "4", "--max-sessions", "4", "--threads", "2", "--threads-per-worker", "2"])
    d.wait_ready()
    daemons[checkout] = d
    clients[checkout] = [Client(str(tmp / f"d{index}.sock")) for _ in range(4)]
def minflt(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])
prompts = [[1, 2, 3, 4, 5, 6, 7, 8][: 5 + i] for i in range(4)]
G = Sampling()
counter = [0]
def run(checkout, steps):
    counter[0] += 1
    tag = counter[0]
    cs = clients[checkout]
    barrier = threading.Barrier(5)
    fin = [0.0] * 4
    toks = [[] for _ in range(4)]
    def sess(i):
        c = cs[i]; s = f"s{tag}-{i}"
        tok = c.append(s, 1, 0, tokens=prompts[i], n_ctx=1024, sample=G).token
        barrier.wait()
        pos = len(prompts[i])
        for _ in range(steps):
            tok = c.append(s, 1, pos, tokens=[tok], sample=G).token; pos += 1
            toks[i].append(tok)
        fin[i] = time.perf_counter()
    ts = [threading.Thread(target=sess, args=(i,)) for i in range(4)]
    for t in ts: t.start()
    barrier.wait(); st = time.perf_counter()
    for t in ts: t.join()
    for i in range(4): cs[i].release(f"s{tag}-{i}", 1)
    return 4 * steps / (max(fin) - st), toks
for c in checkouts: run(c, 4)
rates = {c: [] for c in checkouts}; faults = {c: [] for c in checkouts}; tokens = {}
for k in range(ROUNDS):
    for c in (checkouts if k % 2 == 0 else checkouts[::-1]):
        pids = daemons[c].worker_pids()
        f0 = sum(minflt(p) for p in pids)
        rate, toks = run(c, STEPS)
        faults[c].append((sum(minflt(p) for p in pids) - f0) / (4 * STEPS))
        rates[c].append(rate); tokens[c] = toks
print(f"model {model.name}, {ROUNDS} rounds of {STEPS} steps x 4 sessions, turns alternating; cpu {psutil.cpu_count()} x {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}")
for c in checkouts:
    v = rates[c]
    print(f"{c:14s} tok/s med {statistics.median(v):7.1f} min {min(v):7.1f} max {max(v):7.1f}  worker minor faults a token med {statistics.median(faults[c]):6.1f}  {[round(x, 1) for x in v]}")
print(f"ratio {checkouts[1]} / {checkouts[0]}: {statistics.median(rates[checkouts[1]]) / statistics.median(rates[checkouts[0]]):.3f}")
print("greedy tokens identical:", "yes" if tokens[checkouts[0]] == tokens[checkouts[1]] else "NO")
for c in checkouts:
    for cl in clients[c]: cl.close()
    daemons[c].stop()

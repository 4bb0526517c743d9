"""Route probe (stop 45): the ~1B model's 3 shard daemons (sampled on the last, as section 2's row of record) vs the
same 3 shards in this process (LocalChain's contexts, each shard's append timed) vs the whole model in this process,
in turns of 5 steps (each turn's first step left out). With evidence/daemon-overhead/direct_timing.patch applied, each
hop split by its worker's clock."""
import collections, glob, json, os, pathlib, statistics, sys, tempfile, time, contextlib
import numpy as np
sys.path.insert(0, "/work/main")
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
from workers.runtime.model import ShardModel
from kvpool.local.chain import LocalChain

N_CTX = 1024
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 40
extra = sys.argv[3:]  # extra daemon options
shards = shards_in_parts(model, 3, progress=lambda line: None)
for old in glob.glob("/tmp/direct_times.*.json"):
    os.remove(old)
H = 128
prompt = list(range(200, 200 + H))
feed = list(range(1000, 1000 + rounds * 5 + 10))
local_t, whole_t, route_steps = [], [], []
per_shard = [[], [], []]
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
    daemons = []
    for i, shard in enumerate(shards):
        d = Daemon(shard.path, sockets / f"s{i}.sock", ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1", *extra])
        stack.callback(d.stop); daemons.append(d)
    for d in daemons:
        d.wait_ready()
    whole_m = stack.enter_context(ShardModel(str(model), n_threads=1))
    whole = stack.enter_context(whole_m.new_context(N_CTX))
    chain = stack.enter_context(LocalChain([s.path for s in shards], n_threads=1))
    local = chain.new_session(N_CTX)
    clients = [stack.enter_context(d.client()) for d in daemons]
    sess = Router(clients).session("p", epoch=1)
    sess.sample(prompt, Sampling()); local.append(0, prompt); whole.append(0, tokens=np.asarray(prompt, np.int32))
    pos = H
    for r in range(rounds):
        for name in ("whole", "local", "route"):
            for step in range(5):
                p = pos + step; tok = [feed[p - H]]
                s = time.perf_counter()
                if name == "whole":
                    whole.append(p, tokens=np.asarray(tok, np.int32)); e = time.perf_counter()
                    if step: whole_t.append(e - s)
                elif name == "local":
                    marks = [s]
                    rows = np.asarray(tok, np.int32)
                    for k, c in enumerate(local.contexts):
                        rows = c.append(p, **({"tokens": rows} if k == 0 else {"hidden": rows}))
                        marks.append(time.perf_counter())
                    e = marks[-1]
                    if step:
                        local_t.append(e - s)
                        for k in range(3): per_shard[k].append(marks[k + 1] - marks[k])
                else:
                    sess.sample(tok, Sampling()); e = time.perf_counter()
                    route_steps.append((s, e, bool(step)))
        pos += 5
ms = lambda v: f"{statistics.median(v) * 1e3:.3f}"
rt = [e - s for s, e, k in route_steps if k]
print(f"whole med {ms(whole_t)}  local chain med {ms(local_t)} (per shard {ms(per_shard[0])} {ms(per_shard[1])} {ms(per_shard[2])})  route med {ms(rt)}")
print(f"ratios: route/whole {statistics.median(whole_t)/statistics.median(rt):.3f}x  local/whole {statistics.median(whole_t)/statistics.median(local_t):.3f}x  route vs local {statistics.median(local_t)/statistics.median(rt):.3f}x")
found = sorted(glob.glob("/tmp/direct_times.*.json"))
files = [json.load(open(f)) for f in found]
files = [f for f in files if len(f[0]) >= len(route_steps)]
if len(files) == 3:
    files.sort(key=lambda f: f[0][-1][0])
    # the warm-up prompt request precedes: align on the tail
    marks = [f[0][-len(route_steps):] for f in files]
    parts = collections.defaultdict(list)
    for i, (c0, c1, kept) in enumerate(route_steps):
        if not kept:
            continue
        prev = c0
        for hop in range(3):
            a, b, cs, ce, made, sent = marks[hop][i]
            parts[f"hop{hop} prev sent -> awake"].append(a - prev)
            parts[f"hop{hop} frame+checks"].append(cs - a)
            parts[f"hop{hop} compute"].append(ce - cs)
            parts[f"hop{hop} reply made"].append(made - ce)
            parts[f"hop{hop} reply sent"].append(sent - made)
            prev = sent
        parts["last sent -> client has it"].append(c1 - prev)
        parts["outside compute, all hops"].append((c1 - c0) - sum(marks[h][i][3] - marks[h][i][2] for h in range(3)))
    cpus = [collections.Counter(f[1][-len(route_steps):]) for f in files]
    print("  worker cpus (after reply):", cpus)
    for label, v in parts.items():
        print(f"  {label:32s} med {ms(v)} ms")
    print(f"  in-process per shard: {ms(per_shard[0])} {ms(per_shard[1])} {ms(per_shard[2])}")
else:
    print("no worker marks (patch not applied?)", len(files))

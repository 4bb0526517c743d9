"""Per-step cost at ~1B: in-process runtime step vs a daemon step on the direct channel (steps 2-4 after a
truncate, which forgets the channel) vs the first step after a truncate (through the supervisor)."""
import pathlib, statistics, sys, tempfile, time, contextlib
import numpy as np
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel

N_CTX = 1024
model = pathlib.Path(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
shards = shards_in_parts(model, 3, progress=lambda line: None)
middle = shards[1]
tokens = np.arange(100, 400, dtype=np.int32)
with ShardModel(shards[0].path, n_threads=1) as first, first.new_context(N_CTX) as context:
    hidden = context.append(0, tokens=tokens).copy()
H = 128
res = {k: [] for k in ("runtime step", "daemon step, supervisor (1st after truncate)", "daemon step, direct channel")}
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
    common = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1"]
    daemon = Daemon(middle.path, sockets / "mid.sock", common)
    stack.callback(daemon.stop)
    daemon.wait_ready()
    m = stack.enter_context(ShardModel(middle.path, n_threads=1))
    rt = stack.enter_context(m.new_context(N_CTX))
    client = stack.enter_context(daemon.client())
    S = "probe"
    client.append(S, 1, 0, hidden=hidden[:H])
    rt.append(0, hidden=hidden[:H])
    pos = H
    def t(f):
        s = time.perf_counter(); f(); return time.perf_counter() - s
    for r in range(rounds):
        for step in range(4):
            p = pos + step
            res["runtime step"].append(t(lambda: rt.append(p, hidden=hidden[p:p+1])))
            key = "daemon step, direct channel" if step else "daemon step, supervisor (1st after truncate)"
            res[key].append(t(lambda: client.append(S, 1, p, hidden=hidden[p:p+1])))
        client.truncate(S, 1, pos); rt.truncate(pos)
for k, v in res.items():
    ms = sorted(x * 1e3 for x in v)
    print(f"{k:46s} min {ms[0]:.3f} med {statistics.median(ms):.3f} max {ms[-1]:.3f} ms (n={len(ms)})")

import sys, pathlib, tempfile, contextlib, time, statistics, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
from workers.runtime.model import ShardModel
from kvpool.bench.reference import PlainContext
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]); T = sys.argv[3]
if len(sys.argv) > 4:
    for kv in sys.argv[4:]:
        k, v = kv.split('='); os.environ[k] = v
shards = shards_in_parts(model, 3, progress=lambda line: None)
whole = ShardModel(model, n_threads=int(T)); pc = PlainContext(whole, 1024, n_threads=int(T))
pc.append(0, np.arange(200, 328, dtype=np.int32))
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
    daemons = [Daemon(s.path, sockets / f"s{i}.sock", ["--ttl", "600", "--threads", T, "--threads-per-worker", T, "--n-ctx", "1024", "--max-sessions", "1"]) for i, s in enumerate(shards)]
    for d in daemons: stack.callback(d.stop)
    for d in daemons: d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in daemons]
    sess = Router(clients).session("p", epoch=1)
    sess.sample(list(range(200, 328)), Sampling())
    W=[]; R=[]; pw=128
    for r in range(rounds):
        for i in range(5):
            s=time.perf_counter(); pc.append(pw, np.array([1000+i], dtype=np.int32)); e=time.perf_counter(); pw+=1
            if i: W.append(e-s)
        for i in range(5):
            s=time.perf_counter(); sess.sample([1000+i], Sampling()); e=time.perf_counter()
            if i: R.append(e-s)
m = lambda v: statistics.median(v)*1e3
print(f"threads {T} daemon env {sys.argv[4:]} whole {m(W):.3f} route {m(R):.3f} route/whole speed {m(W)/m(R):.4f}")

"""Idle spin probe (stop 47): a route of the model's three shard daemons (`--threads T --threads-per-worker T --n-ctx
1024 --max-sessions 1 --idle-spin S`) sampling greedy through a Router, and the whole model in this process (T
llama threads, one context), in turns of 5 one-token steps (each turn's first left out), ROUNDS rounds, after a
128-token prompt. Prints each side's median ms a token and the route's speed as a fraction of the whole model's.
This process's own libgomp keeps the environment it was started with. Usage: python idle_spin_probe.py MODEL
ROUNDS T S."""
import contextlib, os, pathlib, statistics, sys, tempfile, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import numpy as np
from kvpool.bench.reference import PlainContext
from kvpool.launcher import Daemon
from kvpool.router.router import Router
from kvpool.shard.cache import shards_in_parts
from kvpool.wire.sampling import Sampling
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]); T = sys.argv[3]; S = sys.argv[4]
shards = shards_in_parts(model, 3, progress=lambda line: None)
whole = ShardModel(model, n_threads=int(T)); pc = PlainContext(whole, 1024, n_threads=int(T))
pc.append(0, np.arange(200, 328, dtype=np.int32))
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
    daemons = [Daemon(s.path, sockets / f"s{i}.sock", ["--ttl", "600", "--threads", T, "--threads-per-worker", T, "--n-ctx", "1024", "--max-sessions", "1", "--idle-spin", S]) for i, s in enumerate(shards)]
    for d in daemons: stack.callback(d.stop)
    for d in daemons: d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in daemons]
    threads_line = clients[0].stats().threads
    sess = Router(clients).session("p", epoch=1)
    sess.sample(list(range(200, 328)), Sampling())
    W, R, pw = [], [], 128
    for r in range(rounds):
        for i in range(5):
            s = time.perf_counter(); pc.append(pw, np.array([1000 + i], dtype=np.int32)); e = time.perf_counter(); pw += 1
            if i: W.append(e - s)
        for i in range(5):
            s = time.perf_counter(); sess.sample([1000 + i], Sampling()); e = time.perf_counter()
            if i: R.append(e - s)
m = lambda v: statistics.median(v) * 1e3
print(f"threads {T} --idle-spin {S} [daemon: {threads_line}] [this process: GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}] "
      f"whole {m(W):.3f} ms (min {min(W)*1e3:.3f} max {max(W)*1e3:.3f})  route {m(R):.3f} ms (min {min(R)*1e3:.3f} max {max(R)*1e3:.3f})  route/whole speed {m(W)/m(R):.4f}")

"""Park / restore through 3 daemons as bench section 7 runs them, with per-stage timings."""
import contextlib, pathlib, statistics, sys, tempfile, time, threading
import numpy as np
from kvpool.bench.rig import start_daemons
from kvpool.client.client import Client
from kvpool.router.route import Route
from kvpool.shard.cache import shards_in_parts
from kvpool.shard.bundled import bundled_model_path
LENGTH = int(sys.argv[1]); ROUNDS = int(sys.argv[2]); MODE = sys.argv[3] if len(sys.argv) > 3 else "parallel"
shards = shards_in_parts(bundled_model_path(), 3)
common = ["--ttl", "600", "--threads-per-worker", "1", "--threads", "1", "--max-sessions", "2", "--n-ctx", "2112", "--budget", "1GiB", "--spill-budget", "1GiB"]
sockdir = pathlib.Path(tempfile.mkdtemp(prefix="kvp-")); sockdir.chmod(0o700)
tokens = list(np.random.default_rng(0).integers(10, 40000, LENGTH + 2))
with contextlib.ExitStack() as stack:
    daemons = start_daemons({f"w{i}": (s.path, common) for i, s in enumerate(shards)}, sockdir, stack)
    clients = [stack.enter_context(Client(d.socket)) for d in daemons.values()]
    route = Route(clients)
    for r in range(ROUNDS):
        sid = f"s{r}"
        route.append(sid, 1, 0, tokens[:LENGTH])
        time.sleep(0.2)
        s = time.perf_counter()
        if MODE == "parallel":
            route.park(sid, 1)
        else:
            each = []
            for c in clients:
                t = time.perf_counter(); c.park(sid, 1); each.append(round((time.perf_counter() - t) * 1e3, 1))
        park = time.perf_counter() - s
        time.sleep(0.2)
        s = time.perf_counter(); route.append(sid, 1, LENGTH, tokens[LENGTH:LENGTH + 1]); rest = time.perf_counter() - s
        s = time.perf_counter(); route.append(sid, 1, LENGTH + 1, tokens[LENGTH + 1:LENGTH + 2]); hot = time.perf_counter() - s
        route.release(sid, 1)
        print(f"park {park*1e3:.1f} {'' if MODE == 'parallel' else each} restore {rest*1e3:.1f} hot {hot*1e3:.1f}", flush=True)

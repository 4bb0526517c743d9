"""Where the Restore request's time goes: 3 daemons as bench section 7; per cycle park (no wait), a waiting park, then
Restore through ask_all (route) or on each daemon alone in turn (seq), then the decode and a hot decode."""
import contextlib, pathlib, statistics, sys, tempfile, time
import numpy as np
from kvpool.bench.rig import start_daemons
from kvpool.client.client import Client
from kvpool.router.route import Route
from kvpool.shard.cache import shards_in_parts
from kvpool.shard.bundled import bundled_model_path
LENGTH = int(sys.argv[1]); ROUNDS = int(sys.argv[2])
shards = shards_in_parts(bundled_model_path(), 3)
common = ["--ttl", "600", "--threads-per-worker", "1", "--threads", "1", "--max-sessions", "2", "--n-ctx", "2112", "--budget", "1GiB", "--spill-budget", "1GiB"]
sockdir = pathlib.Path(tempfile.mkdtemp(prefix="kvp-")); sockdir.chmod(0o700)
tokens = [int(t) for t in np.random.default_rng(0).integers(10, 40000, LENGTH + 8 * ROUNDS + 2)]
times = {}
def note(name, value):
    times.setdefault(name, []).append(value * 1e3)
with contextlib.ExitStack() as stack:
    daemons = start_daemons({f"w{i}": (s.path, common) for i, s in enumerate(shards)}, sockdir, stack)
    clients = [stack.enter_context(Client(d.socket)) for d in daemons.values()]
    route = Route(clients)
    sid = "s"
    route.append(sid, 1, 0, tokens[:LENGTH])
    at = LENGTH
    for r in range(ROUNDS):
        for kind in ("route", "seq", "append"):
            route.park(sid, 1, wait=False)
            route.park(sid, 1)
            s = time.perf_counter()
            if kind == "route":
                route.restore(sid, 1)
            elif kind == "seq":
                for i, c in enumerate(clients):
                    t = time.perf_counter(); c.restore(sid, 1); note(f"seq restore daemon {i}", time.perf_counter() - t)
            note(f"{kind} restore", time.perf_counter() - s)
            route.append(sid, 1, at, tokens[at:at + 1]); at += 1
            note(f"{kind} restore+decode", time.perf_counter() - s)
            s = time.perf_counter(); route.append(sid, 1, at, tokens[at:at + 1]); at += 1
            note(f"{kind} hot", time.perf_counter() - s)
    route.release(sid, 1)
for name, xs in sorted(times.items()):
    print(f"{name}: min {min(xs):.2f} med {statistics.median(xs):.2f} max {max(xs):.2f} ms (n={len(xs)})")

"""Park answered before its save (Park.wait false) through 3 daemons as bench section 7 runs them: per variant, the
park's answer, the saves done (a waiting park answered), the restoring decode, the hot decode."""
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
tokens = [int(t) for t in np.random.default_rng(0).integers(10, 40000, LENGTH + 2 * ROUNDS + 2)]
times = {}
def note(name, value):
    times.setdefault(name, []).append(value * 1e3)
with contextlib.ExitStack() as stack:
    daemons = start_daemons({f"w{i}": (s.path, common) for i, s in enumerate(shards)}, sockdir, stack)
    clients = [stack.enter_context(Client(d.socket)) for d in daemons.values()]
    route = Route(clients)
    import concurrent.futures
    pool = concurrent.futures.ThreadPoolExecutor(3)
    from kvpool.wire.protocol import Park, encode
    from kvpool.client.connection import _receive_reply
    for variant in ("route", "pipelined", "route", "pipelined"):
        sid = f"s-{variant}-{time.monotonic()}"
        route.append(sid, 1, 0, tokens[:LENGTH])
        for r in range(ROUNDS):
            at = LENGTH + 2 * r
            s = time.perf_counter()
            if variant == "route":
                route.park(sid, 1, wait=False)
            elif variant == "sequential":
                for i, c in enumerate(clients):
                    t = time.perf_counter(); c.park(sid, 1, wait=False); note(f"{variant} park daemon {i}", time.perf_counter() - t)
            elif variant == "pipelined":
                conns = [c._connection("main") for c in clients]
                for i, conn in enumerate(conns):
                    c = clients[i]; c._channels.forget(sid, 1)
                    conn.sock.sendall(encode(Park(session_id=sid, epoch=1, wait=False, request_id=90000 + r)))
                for conn in conns:
                    reply = _receive_reply(conn.sock); assert reply.detail == "parking", reply
            elif variant == "pool":
                list(pool.map(lambda c: c.park(sid, 1, wait=False), clients))
            else:
                route.park(sid, 1)
            note(f"{variant} park", time.perf_counter() - s)
            route.park(sid, 1)
            note(f"{variant} saved", time.perf_counter() - s)
            s = time.perf_counter(); route.append(sid, 1, at, tokens[at:at + 1]); note(f"{variant} restoring decode", time.perf_counter() - s)
            s = time.perf_counter(); route.append(sid, 1, at + 1, tokens[at + 1:at + 2]); note(f"{variant} hot decode", time.perf_counter() - s)
        route.release(sid, 1)
for name, xs in times.items():
    print(f"{name}: min {min(xs):.2f} med {statistics.median(xs):.2f} max {max(xs):.2f} ms (n={len(xs)})")

"""The client's side of a route's decode step: 3 daemons on the bundled model's shards, a routed session, 300 steps
timed with the client's thread CPU time, then 300 under cProfile (sorted by own time)."""
import cProfile, contextlib, pathlib, pstats, sys, tempfile, time
sys.path.insert(0, "/work/main")
from kvpool.launcher import Daemon
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
shards = sorted(pathlib.Path("/work/main/.kvpool/shards/b179c9523d0e").glob("*.gguf"))
sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-cp-"))
options = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "2048", "--max-sessions", "1"]
with contextlib.ExitStack() as stack:
    daemons = [Daemon(s, sockets / f"s{k}.sock", options) for k, s in enumerate(shards)]
    for d in daemons:
        stack.callback(d.stop)
    for d in daemons:
        d.wait_ready()
    route = Router([stack.enter_context(d.client()) for d in daemons]).session("cp", epoch=1)
    route.sample(list(range(200, 300)), Sampling())
    token = 1000
    for rnd in range(3):
        c0, w0 = time.thread_time(), time.perf_counter()
        for i in range(300):
            token = route.sample([token], Sampling()).token
        c1, w1 = time.thread_time(), time.perf_counter()
        print(f"round {rnd}: {(w1 - w0) / 300 * 1e3:.3f} ms a step, client thread CPU {(c1 - c0) / 300 * 1e3:.3f} ms a step")
        route.truncate(100)
    profile = cProfile.Profile()
    profile.enable()
    for i in range(300):
        token = route.sample([token], Sampling()).token
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)

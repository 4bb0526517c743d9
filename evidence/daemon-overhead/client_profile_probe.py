"""The client's own Python per routed, sampled decode step (bundled model, 3 shard daemons): cProfile of the
client process over N steps; the daemons' time shows up as socket waits."""
import cProfile, pstats, pathlib, sys, tempfile, time, contextlib, statistics, io
from kvpool.launcher import Daemon
from kvpool.router.router import Router
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
from kvpool.wire.protocol import Sampling
N = int(sys.argv[1]) if len(sys.argv) > 1 else 300
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda line: None)
with contextlib.ExitStack() as stack:
    d = pathlib.Path(tempfile.mkdtemp())
    daemons = [Daemon(s.path, d / f"{i}.sock", ["--threads", "1", "--n-ctx", "1024", "--max-sessions", "1", "--ttl", "600"]) for i, s in enumerate(shards)]
    for x in daemons: stack.callback(x.stop)
    for x in daemons: x.wait_ready()
    clients = [stack.enter_context(x.client()) for x in daemons]
    session = Router(clients).session("p", epoch=1)
    token = session.sample(list(range(1, 65)), Sampling()).token
    steps = []
    profile = cProfile.Profile()
    for i in range(N):
        if session.length > 1000:
            session.truncate(64)
        s = time.perf_counter()
        if i >= N // 2: profile.enable()
        token = session.sample([token], Sampling()).token
        if i >= N // 2: profile.disable()
        steps.append(time.perf_counter() - s)
    print(f"step med {statistics.median(steps)*1e3:.3f} ms")
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats("tottime")
    stats.print_stats(25)
    print(out.getvalue()[:6000])

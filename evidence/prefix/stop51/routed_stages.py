import sys, pathlib, tempfile, contextlib, time, statistics
sys.path.insert(0, "/tmp/dev51")
from kvpool.bench.prefix import DAEMON_OPTIONS, _routed_once, message, system_prompt, _components_once
from kvpool.launcher import Daemon
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
import kvpool.router.route as rr
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda line: None)
sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
S = []
orig = rr.Route.append_at
def timed(self, stage, *a, **k):
    t0 = time.perf_counter(); r = orig(self, stage, *a, **k); S.append((stage, time.perf_counter() - t0, k.get("block_digests"), k.get("sample"), k.get("n_ctx"))); return r
rr.Route.append_at = timed
with contextlib.ExitStack() as stack:
    daemons = [Daemon(s.path, sockets / f"s{i}.sock", DAEMON_OPTIONS) for i, s in enumerate(shards)]
    for d in daemons: stack.callback(d.stop)
    for d in daemons: d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in daemons]
    tok = stack.enter_context(Tokenizer(shards[0].path))
    system = system_prompt(tok, 1024)
    _routed_once(clients, "seed", system + message(tok, "seed"), prefix_cache=True)
    _routed_once(clients, "warm", system + message(tok, "warm"), prefix_cache=True)
    R, C = [], []
    for r in range(6):
        S.clear()
        t = _routed_once(clients, f"r{r}", system + message(tok, str(r)), prefix_cache=True)
        R.append([x[1] for x in S])
        c = _components_once(clients, f"c{r}", system, message(tok, f"{r}c"))
        C.append(c["first_append_s"])
        print(f"routed {t['s']*1e3:.1f} stages " + " ".join(f"{x*1e3:.1f}" for x in R[-1]) + f" | comp first " + " ".join(f"{x*1e3:.1f}" for x in C[-1]) + f" hot " + " ".join(f"{x*1e3:.1f}" for x in c["hot_append_s"]), flush=True)
    print(S[0][2:], )

"""Section 12's gap (stop 51): the routed cached session timed stage by stage (Route.append_at wrapped) and the
lookup+admission apart, in rounds that also run what the bench runs between (an uncached session through the same
daemons, llama.cpp's kept context in this process) and the component session. Usage: python gap_probe.py ROUNDS."""
import sys, pathlib, tempfile, contextlib, time, statistics
sys.path.insert(0, "/work/main")
import numpy as np
from kvpool.bench.options import PREFIX_N_CTX, SINGLE_THREADS
from kvpool.bench.prefix import DAEMON_OPTIONS, _routed_once, message, system_prompt, _components_once, _llama_once
from kvpool.bench.reference import PlainContext
from kvpool.launcher import Daemon
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel
import kvpool.router.route as rr
import kvpool.router.prefix as rp
S = []
orig = rr.Route.append_at
def timed(self, stage, *a, **k):
    t0 = time.perf_counter(); r = orig(self, stage, *a, **k); S.append((f"stage{stage}", time.perf_counter() - t0)); return r
rr.Route.append_at = timed
for name in ("held_everywhere", "admit_everywhere"):
    f = getattr(rp, name)
    def wrap(*a, _f=f, _n=name, **k):
        t0 = time.perf_counter(); r = _f(*a, **k); S.append((_n, time.perf_counter() - t0)); return r
    setattr(rp, name, wrap)
import kvpool.router.session as rs
rs.held_everywhere, rs.admit_everywhere = rp.held_everywhere, rp.admit_everywhere
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda line: None)
sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
rounds = int(sys.argv[1])
with contextlib.ExitStack() as stack:
    daemons = [Daemon(s.path, sockets / f"s{i}.sock", DAEMON_OPTIONS) for i, s in enumerate(shards)]
    for d in daemons: stack.callback(d.stop)
    for d in daemons: d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in daemons]
    tok = stack.enter_context(Tokenizer(shards[0].path))
    whole = stack.enter_context(ShardModel(bundled_model_path(), n_threads=SINGLE_THREADS)) if hasattr(ShardModel, "__enter__") else ShardModel(bundled_model_path(), n_threads=SINGLE_THREADS)
    system = system_prompt(tok, 1024)
    kept = PlainContext(whole, PREFIX_N_CTX, n_threads=SINGLE_THREADS)
    kept.append(0, np.asarray(system, dtype=np.int32)); state = kept.save_state()
    _routed_once(clients, "seed", system + message(tok, "seed"), prefix_cache=True)
    for r in range(rounds):
        before = ["uncached", "llama", "components"] if r % 2 == 0 else ["components", "llama", "uncached"]
        for name in before:
            if name == "uncached":
                t = _routed_once(clients, f"u{r}", system + message(tok, str(r)), prefix_cache=False)["s"]
            elif name == "llama":
                t = _llama_once(kept, state, len(system), message(tok, str(r)))["s"]
            else:
                c = _components_once(clients, f"c{r}", system, message(tok, f"{r}c")); t = c["lookup_s"] + c["admit_s"] + sum(c["first_append_s"])
            print(f"round {r} {name:10s} {t*1e3:9.1f} ms", flush=True)
        S.clear()
        t = _routed_once(clients, f"r{r}", system + message(tok, str(r)), prefix_cache=True)
        parts = " ".join(f"{n} {s*1e3:.1f}" for n, s in S)
        print(f"round {r} cached     {t['s']*1e3:9.1f} ms = {parts}; sum {sum(s for _, s in S)*1e3:.1f}", flush=True)
    kept.close()

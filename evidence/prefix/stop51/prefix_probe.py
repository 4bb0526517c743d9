"""Prefix probe (stop 51): section 12's cached path on the bundled model, step by step per daemon, the three
supervisors optionally under cProfile (PROFILE=1). Usage: python prefix_probe.py ROUNDS [ROOT]."""
import contextlib, os, pathlib, statistics, sys, tempfile, time
ROOT = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "/work/main")
sys.path.insert(0, str(ROOT))
from kvpool.bench.prefix import DAEMON_OPTIONS, _components_once, _routed_once, message, system_prompt
from kvpool.launcher import Daemon
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts

rounds = int(sys.argv[1])
out = pathlib.Path(os.environ.get("OUT", "/tmp/p51/prof"))
out.mkdir(parents=True, exist_ok=True)
if os.environ.get("PROFILE") == "1":
    wrapper = out / "python-prof"
    wrapper.write_text(f'#!/bin/bash\nexec {sys.executable} -m cProfile -o {out}/prof.$$ "$@"\n')
    wrapper.chmod(0o755)
    real = sys.executable
    sys.executable = str(wrapper)
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda line: None)
sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
with contextlib.ExitStack() as stack:
    daemons = [Daemon(s.path, sockets / f"s{i}.sock", DAEMON_OPTIONS) for i, s in enumerate(shards)]
    if os.environ.get("PROFILE") == "1":
        sys.executable = real
    for d in daemons:
        stack.callback(d.stop)
    for d in daemons:
        d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in daemons]
    tokenizer = stack.enter_context(Tokenizer(shards[0].path))
    system = system_prompt(tokenizer, 1024)
    seed = _routed_once(clients, "seed", system + message(tokenizer, "seed"), prefix_cache=True)
    print(f"seed prefill {seed['s']:.2f} s", flush=True)
    comp, routed = [], []
    for r in range(rounds + 1):
        c = _components_once(clients, f"c{r}", system, message(tokenizer, f"{r}c"))
        t = _routed_once(clients, f"r{r}", system + message(tokenizer, str(r)), prefix_cache=True)
        if r:
            comp.append(c); routed.append(t)
    med = lambda xs: statistics.median(xs) * 1e3
    for key in ("lookup_s", "admit_s", "restore_s", "ahead_wait_s", "first_append_s", "hot_append_s"):
        if key not in comp[0]:
            continue
        if isinstance(comp[0][key], list):
            print(f"{key:16s}", " ".join(f"{med([c[key][i] for c in comp]):8.2f}" for i in range(3)), f"ms (sum {med([sum(c[key]) for c in comp]):.2f})")
        else:
            print(f"{key:16s} {med([c[key] for c in comp]):8.2f} ms (every daemon at once)")
    print("first - hot     ", " ".join(f"{med([c['first_append_s'][i] - c['hot_append_s'][i] for c in comp]):8.2f}" for i in range(3)), "ms")
    print(f"routed cached ttft med {med([t['s'] for t in routed]):.1f} ms (min {min(t['s'] for t in routed)*1e3:.1f} max {max(t['s'] for t in routed)*1e3:.1f}); capture wait med {med([t['capture_s'] for t in routed]):.2f} ms; hits {sum(t['hits'] for t in routed)}")

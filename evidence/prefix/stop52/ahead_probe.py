"""Ahead probe (stop 52): section 12's cached path on the bundled model with the later daemons restored ahead
(RestoringAhead, as the router does) and without (each daemon restores with its own append), taking turns round
by round on the same three daemons. Usage: python ahead_probe.py ROUNDS [ROOT]."""
import contextlib, pathlib, statistics, sys, tempfile
ROOT = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "/work/main")
sys.path.insert(0, str(ROOT))
from kvpool.bench.prefix import DAEMON_OPTIONS, _components_once, _routed_once, message, system_prompt
from kvpool.launcher import Daemon
from kvpool.local.tokenizer import Tokenizer
from kvpool.router.prefix import RestoringAhead
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts

rounds = int(sys.argv[1])
real_start = RestoringAhead.start
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda line: None)
sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
with contextlib.ExitStack() as stack:
    daemons = [Daemon(s.path, sockets / f"s{i}.sock", DAEMON_OPTIONS) for i, s in enumerate(shards)]
    for d in daemons:
        stack.callback(d.stop)
    for d in daemons:
        d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in daemons]
    tokenizer = stack.enter_context(Tokenizer(shards[0].path))
    system = system_prompt(tokenizer, 1024)
    seed = _routed_once(clients, "seed", system + message(tokenizer, "seed"), prefix_cache=True)
    print(f"seed prefill {seed['s']:.2f} s", flush=True)
    got = {"ahead": ([], []), "none": ([], [])}
    for r in range(rounds + 1):
        for way in (("ahead", "none") if r % 2 else ("none", "ahead")):
            RestoringAhead.start = real_start if way == "ahead" else classmethod(lambda cls, *a, **k: None)
            c = _components_once(clients, f"c{r}{way}", system, message(tokenizer, f"{r}c{way}"))
            t = _routed_once(clients, f"r{r}{way}", system + message(tokenizer, f"{r}{way}"), prefix_cache=True)
            if r:
                got[way][0].append(c); got[way][1].append(t)
    RestoringAhead.start = real_start
    med = lambda xs: statistics.median(xs) * 1e3
    for way, (comp, routed) in got.items():
        print(f"== {way}")
        print("first - hot     ", " ".join(f"{med([c['first_append_s'][i] - c['hot_append_s'][i] for c in comp]):8.2f}" for i in range(3)), "ms")
        print("hot             ", " ".join(f"{med([c['hot_append_s'][i] for c in comp]):8.2f}" for i in range(3)), "ms")
        print(f"component first append sum med {med([sum(c['first_append_s']) for c in comp]):.1f} ms; admission {med([c['admit_s'] for c in comp]):.1f} ms")
        print(f"routed cached ttft med {med([t['s'] for t in routed]):.1f} ms (min {min(t['s'] for t in routed)*1e3:.1f} max {max(t['s'] for t in routed)*1e3:.1f}); capture wait med {med([t['capture_s'] for t in routed]):.2f} ms; hits {sum(t['hits'] for t in routed)}")

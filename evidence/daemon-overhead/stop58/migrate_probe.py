"""Does moving between CPUs from hop to hop cost the in-process chain what the route loses? LocalChain's three
contexts in this process, 1 thread; variants in turns of 6 one-token steps (first left out):
  floating        the thread's CPUs left to the scheduler
  cpu0            every hop on CPU 0
  alternate       hop i on CPU (i + step) % 2: every hop on the other CPU than the one before
Usage: migrate_probe.py MODEL ROUNDS"""
import os, pathlib, statistics, sys, time, contextlib
sys.path.insert(0, os.getcwd())  # run from a checkout (stop 58 ran it with /work/main here)
import numpy as np
from kvpool.shard.cache import shards_in_parts
from kvpool.local.chain import LocalChain
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2])
shards = shards_in_parts(model, 3, progress=lambda line: None)
ALL = os.sched_getaffinity(0)
with contextlib.ExitStack() as stack:
    chain = stack.enter_context(LocalChain([s.path for s in shards], n_threads=1))
    sessions = {}
    names = ["floating", "cpu0", "alternate"]
    for n in names:
        cs = chain.new_session(1024); cs.append(0, list(range(200, 328))); sessions[n] = cs
    T = {n: [] for n in names}; H = {n: [[], [], []] for n in names}
    k = 0
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            cs = sessions[name]
            os.sched_setaffinity(0, {0} if name == "cpu0" else ALL)
            for step in range(6):
                pos = cs.length
                s = time.perf_counter()
                first, *rest = cs.contexts
                for i, ctx in enumerate(cs.contexts):
                    if name == "alternate":
                        k += 1; os.sched_setaffinity(0, {k % 2})
                    h = time.perf_counter()
                    if i == 0:
                        rows = ctx.append(pos, tokens=np.array([1000 + step], dtype=np.int32), output_rows="last")
                    else:
                        rows = ctx.append(pos, hidden=rows, output_rows="last")
                    if step: H[name][i].append(time.perf_counter() - h)
                e = time.perf_counter()
                if step: T[name].append(e - s)
        if sessions["floating"].length > 980:
            break
    os.sched_setaffinity(0, ALL)
    print(f"rounds {r+1}, medians ms a token (hops' medians):")
    base = statistics.median(T["floating"])
    for n in names:
        m = statistics.median(T[n])
        print(f"  {n:12s} {m*1e3:8.3f}  speed vs floating {base/m:.3f}  hops " + " ".join(f"{statistics.median(h)*1e3:.3f}" for h in H[n]))

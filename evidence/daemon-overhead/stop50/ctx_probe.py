"""Per-context draw: the whole ~1B model loaded once (huge pages for the load, as every ShardModel), `plain` PlainContexts
(the bench's reference) on 4 KiB pages as created, then `plain` more whose new anonymous mappings were collapsed into
huge pages right after creation (workers.runtime.huge_pages.MappingWatch), each timed in turns: `rounds` turns of 40
one-token steps after a 128-token prompt. Usage: python ctx_probe.py MODEL ROUNDS PLAIN [--no-watch: only the PLAIN contexts]"""
import statistics, sys, time
sys.path.insert(0, "/work/main")
import numpy as np
from workers.runtime.model import ShardModel
from workers.runtime.huge_pages import MappingWatch
from kvpool.bench.reference import PlainContext

model, rounds, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def run(context, steps=40):
    context.reset(); context.append(0, np.arange(200, 328, dtype=np.int32))
    out = []
    for p in range(128, 128 + steps):
        s = time.perf_counter(); context.append(p, np.asarray([p % 1000], np.int32)); out.append(time.perf_counter() - s)
    return out[3:]


with ShardModel(model, n_threads=1) as m:
    contexts = {}
    for i in range(count):
        contexts[f"4k{i}"] = PlainContext(m, 1024, n_threads=1)
    for i in range(count if "--no-watch" not in sys.argv else 0):
        watch = MappingWatch(True)
        contexts[f"huge{i}"] = PlainContext(m, 1024, n_threads=1)
        print(f"huge{i}:", watch.collapse().describe())
    print("AnonHugePages MiB", [int(l.split()[1]) // 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")])
    times = {name: [] for name in contexts}
    turns = {name: [] for name in contexts}
    names = list(contexts)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            values = run(contexts[name])
            times[name].extend(values)
            turns[name].append(statistics.median(values) * 1e3)
    for name, values in times.items():
        print(f"{name:7s} median {statistics.median(values)*1e3:7.3f} ms   per turn " + " ".join(f"{v:6.2f}" for v in turns[name]))
    for c in contexts.values():
        c.close()

"""Where a daemon step goes at ~1B, middle shard (or the shard the third argument names: 2, the last, stop 43): the worker runtime in this process against the daemon on the
direct channel, in turns of 5 steps (each turn's first step left out), and, with evidence/daemon-overhead/
direct_timing.patch applied to workers/server/direct.py (temporary: it writes /tmp/direct_times.<pid>.json when
the worker stops), the daemon's step split by the worker's own clock: the request's way in, the frame, the checks,
llama.cpp's compute of the step, the reply's making, its sending, and its way back. Prints per-CPU medians too
(the runtime's steps and the worker's computes by the CPU they ended on)."""
import collections, glob, json, os, pathlib, statistics, sys, tempfile, time, contextlib
import numpy as np
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel

N_CTX = 1024
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 60
shards = shards_in_parts(model, 3, progress=lambda line: None)
middle = shards[int(sys.argv[3]) if len(sys.argv) > 3 else 1]
with ShardModel(shards[0].path, n_threads=1) as first, first.new_context(N_CTX) as context:
    rows = context.append(0, tokens=np.arange(100, 100 + N_CTX - 10, dtype=np.int32), output_rows="all").copy()
if middle is shards[2]:
    with ShardModel(shards[1].path, n_threads=1) as second, second.new_context(N_CTX) as context:
        rows = context.append(0, hidden=rows, output_rows="all").copy()

def cpu() -> int:
    return int(open("/proc/thread-self/stat").read().rsplit(")", 1)[1].split()[36])

H, runtime, daemon_steps = 128, [], []
for old in glob.glob("/tmp/direct_times.*.json"):
    os.remove(old)
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
    daemon = Daemon(middle.path, sockets / "mid.sock", ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1"])
    stack.callback(daemon.stop)
    daemon.wait_ready()
    m = stack.enter_context(ShardModel(middle.path, n_threads=1))
    rt = stack.enter_context(m.new_context(N_CTX))
    client = stack.enter_context(daemon.client())
    client.append("p", 1, 0, hidden=rows[:H]); rt.append(0, hidden=rows[:H])
    pos = H
    for r in range(rounds):
        for name in ("runtime", "daemon"):
            for step in range(5):
                p = pos + step
                s = time.perf_counter()
                if name == "runtime":
                    rt.append(p, hidden=rows[p:p + 1]); e = time.perf_counter()
                    if step: runtime.append((e - s, cpu()))
                else:
                    client.append("p", 1, p, hidden=rows[p:p + 1]); e = time.perf_counter()
                    daemon_steps.append((s, e, bool(step)))
        pos += 5
        if pos > N_CTX - 20:
            client.truncate("p", 1, H); rt.truncate(H); pos = H
ms = lambda values: f"{statistics.median(values) * 1e3:.3f}"
timed = [e - s for s, e, kept in daemon_steps if kept]
print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}: runtime step med {ms([d for d, _ in runtime])} ms, daemon step med {ms(timed)} ms, "
      f"ratio {statistics.median([d for d, _ in runtime]) / statistics.median(timed):.3f} (n={len(timed)} each)")
found = glob.glob("/tmp/direct_times.*.json")
if found:
    marks, cpus = json.load(open(found[0]))
    parts = collections.defaultdict(list)
    for (c0, c1, kept), (a, b, cs, ce, made, sent), where in zip(daemon_steps, marks, cpus):
        if not kept:
            continue
        for label, value in (("client send -> worker awake", a - c0), ("frame read + decoded", b - a), ("checks, rows", cs - b),
                             ("llama compute (ShardContext.append)", ce - cs), ("reply made", made - ce), ("reply sent", sent - made),
                             ("worker sent -> client has it", c1 - sent), ("outside the compute", (c1 - c0) - (ce - cs))):
            parts[label].append(value)
        parts[f"llama compute on cpu {where}"].append(ce - cs)
    for label, values in parts.items():
        print(f"  daemon: {label:38s} med {ms(values)} ms (n={len(values)})")
by_cpu = collections.defaultdict(list)
for d, where in runtime:
    by_cpu[where].append(d)
for where, values in sorted(by_cpu.items()):
    print(f"  runtime: step on cpu {where:<27d} med {ms(values)} ms (n={len(values)})")

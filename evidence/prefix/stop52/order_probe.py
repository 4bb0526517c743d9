"""Run-order probe (stop 52): section 12's three ~1B shard daemons started and stopped ROUNDS times back to back,
each time with the whole model loaded in this process as the bench loads it; per round: every worker's and this
process's anonymous memory in transparent huge pages (smaps_rollup), /proc/buddyinfo's free order-9/10 blocks,
and the median of 20 one-row decode steps of the whole model in this process and of 20 through the route.
Usage: python order_probe.py MODEL ROUNDS [ROOT]."""
import contextlib, pathlib, statistics, sys, tempfile, time
ROOT = pathlib.Path(sys.argv[3] if len(sys.argv) > 3 else "/work/main")
sys.path.insert(0, str(ROOT))
import numpy as np
from kvpool.bench.options import PREFIX_N_CTX, SINGLE_THREADS
from kvpool.bench.prefix import DAEMON_OPTIONS
from kvpool.launcher import Daemon
from kvpool.router.router import Router
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel

def rollup(pid):
    fields = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        parts = line.split()
        if len(parts) >= 3 and parts[-1] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1]) // 1024
    return fields.get("AnonHugePages", 0), fields.get("Anonymous", 0)

def free_high_order():
    normal = [line.split() for line in open("/proc/buddyinfo") if "Normal" in line][0]
    return int(normal[-2]), int(normal[-1])

model = pathlib.Path(sys.argv[1])
shards = shards_in_parts(model, 3, progress=lambda line: None)
for round_index in range(int(sys.argv[2])):
    before = free_high_order()
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-order-"))
    with contextlib.ExitStack() as stack:
        daemons = [Daemon(s.path, sockets / f"o{i}.sock", DAEMON_OPTIONS) for i, s in enumerate(shards)]
        for d in daemons:
            stack.callback(d.stop)
        for d in daemons:
            d.wait_ready()
        clients = [stack.enter_context(d.client()) for d in daemons]
        whole = stack.enter_context(ShardModel(model, n_threads=SINGLE_THREADS))
        context = stack.enter_context(whole.new_context(PREFIX_N_CTX))
        session = Router(clients, prefix_cache=False).session(f"order-{round_index}")
        session.append(list(range(100, 132)))
        context.append(0, tokens=np.asarray(list(range(100, 132)), np.int32))
        routed, local = [], []
        for step in range(20):
            started = time.perf_counter()
            session.append([200 + step])
            routed.append(time.perf_counter() - started)
            started = time.perf_counter()
            context.append(32 + step, tokens=np.asarray([200 + step], np.int32))
            local.append(time.perf_counter() - started)
        workers = [(w.pid, w.huge_page_bytes >> 20) for c in clients for w in c.stats().workers]
        pages = [rollup(pid) for pid, _ in workers]
        mine = rollup("self")
        session.release()
    print(f"round {round_index + 1}: free order-9/10 blocks before {before}; workers' AnonHugePages/Anonymous MiB now {pages} "
          f"(at ready {[mib for _, mib in workers]}); this process {mine}; decode med: route {statistics.median(routed) * 1e3:.1f} ms, "
          f"whole model here {statistics.median(local) * 1e3:.1f} ms, ratio {statistics.median(local) / statistics.median(routed):.3f}", flush=True)

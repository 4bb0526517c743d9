import os, sys, time, statistics, subprocess, psutil
shard = ".kvpool/shards/a94e23f3de4e/llama-1b.Q4_K_M.layers-08-15.gguf"
child = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from workers.runtime.model import ShardModel
m = ShardModel({shard!r}); c = m.new_context(1024)
print('ready', flush=True); sys.stdin.readline()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
assert child.stdout.readline().strip() == "ready"
p = psutil.Process(child.pid)
for name, f in [("memory_full_info", lambda: p.memory_full_info()), ("smaps_rollup read", lambda: open(f"/proc/{child.pid}/smaps_rollup").read()), ("memory_info", lambda: p.memory_info())]:
    ts = []
    for _ in range(15):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    print(f"{name:20s} med {statistics.median(ts)*1e3:.2f} ms min {min(ts)*1e3:.2f} max {max(ts)*1e3:.2f}")
print(open(f"/proc/{child.pid}/smaps_rollup").read())
child.stdin.write("\n"); child.stdin.flush(); child.wait()

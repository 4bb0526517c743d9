import pathlib, sys, tempfile, subprocess, os
import numpy as np
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
shards = shards_in_parts(pathlib.Path(sys.argv[1]), 3, progress=lambda line: None)
mid = shards[1]
d = Daemon(mid.path, pathlib.Path(tempfile.mkdtemp()) / "m.sock", ["--ttl","600","--threads","1","--threads-per-worker","1","--n-ctx","1024","--max-sessions","1"])
d.wait_ready()
c = d.client()
rows = (np.random.default_rng(0).standard_normal((200, mid.shape.n_embd)) * 0.1).astype(np.float32)
c.append("s",1,0,hidden=rows[:128])
for pid in subprocess.run(["pgrep", "-f", "multiprocessing.spawn"], capture_output=True, text=True).stdout.split():
    roll = open(f"/proc/{pid}/smaps_rollup").read()
    print(pid, [l for l in roll.splitlines() if l.startswith(("Rss", "AnonHugePages", "Anonymous"))])
c.close(); d.stop()

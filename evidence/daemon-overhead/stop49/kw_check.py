import os, pathlib, sys, tempfile, time, subprocess, contextlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from kvpool.launcher import Daemon
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda l: None)
with contextlib.ExitStack() as st:
    ds = [Daemon(s.path, pathlib.Path(tempfile.mkdtemp()) / f"m{i}.sock", ["--keep-warm", "0.5", "--max-sessions", "1"]) for i, s in enumerate(shards)]
    for d in ds: st.callback(d.stop)
    for d in ds: d.wait_ready()
    kids = [k for d in ds for k in subprocess.run(["pgrep", "-P", str(d.process.pid), "-f", "keep_warm"], capture_output=True, text=True).stdout.split()]
    ticks = lambda: [int(open(f"/proc/{k}/stat").read().split()[13]) for k in kids]
    sess = Router([st.enter_context(d.client()) for d in ds]).session("p", epoch=1)
    sess.sample(list(range(200, 260)), Sampling())
    time.sleep(1.0)
    a = ticks(); t = time.time()
    for i in range(150): sess.sample([300 + i], Sampling())
    b = ticks(); print("3 s of decode:", round(time.time() - t, 2), "s; spinner ticks", [y - x for x, y in zip(a, b)], [os.sched_getscheduler(int(k)) for k in kids], [os.sched_getaffinity(int(k)) for k in kids])

"""--keep-warm on and off in interleaved turns of one run: the ~1B model's 3 shard daemons (--keep-warm 1) as a
Router route sampling greedy, and the whole model in this process (1 thread); the daemons' spinner processes
stopped (SIGSTOP) or running (SIGCONT) turn by turn, so the host's drift falls alike on both. Turns of 5
one-token steps (each turn's first left out): route spinning, whole spinning, route stopped, whole stopped.
Usage: kw_interleave.py MODEL ROUNDS [daemon options]"""
import os, pathlib, signal, statistics, subprocess, sys, tempfile, time, contextlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import numpy as np
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
from kvpool.bench.reference import PlainContext
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]); extra = sys.argv[3:]
shards = shards_in_parts(model, 3, progress=lambda line: None)
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1", "--keep-warm", "1", *extra]
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-kw-"))
    ds = [Daemon(s.path, sockets / f"s{i}.sock", opts) for i, s in enumerate(shards)]
    for d in ds: stack.callback(d.stop)
    for d in ds: d.wait_ready()
    spinners = [int(k) for d in ds for k in subprocess.run(["pgrep", "-P", str(d.process.pid), "-f", "keep_warm"], capture_output=True, text=True).stdout.split()]
    assert len(spinners) == 3 * len(os.sched_getaffinity(0)), spinners
    def spinners_run(on):
        for pid in spinners: os.kill(pid, signal.SIGCONT if on else signal.SIGSTOP)
    stack.callback(spinners_run, True)
    clients = [stack.enter_context(d.client()) for d in ds]
    sess = Router(clients).session("p", epoch=1)
    sess.sample(list(range(200, 328)), Sampling())
    whole = stack.enter_context(ShardModel(model, n_threads=1)); pc = PlainContext(whole, 1024, n_threads=1)
    pc.append(0, np.arange(200, 328, dtype=np.int32)); wpos = 128
    T = {k: [] for k in ("route spinning", "whole spinning", "route stopped", "whole stopped")}
    for r in range(rounds):
        for name in T:
            spinners_run("spinning" in name)
            for step in range(5):
                s = time.perf_counter()
                if name.startswith("whole"):
                    pc.append(wpos, np.array([1000 + step], dtype=np.int32)); wpos += 1
                else:
                    sess.sample([1000 + step], Sampling())
                e = time.perf_counter()
                if step: T[name].append(e - s)
        if wpos > 1000 - 12:
            pc.truncate(128); wpos = 128
    m = {k: statistics.median(v) * 1e3 for k, v in T.items()}
    print(f"rounds {rounds} ({' '.join(extra) or 'no extra options'}): " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))
    print(f"  route/whole speed: spinning {m['whole spinning']/m['route spinning']:.3f}, stopped {m['whole stopped']/m['route stopped']:.3f};"
          f" route stopped/spinning time {m['route stopped']/m['route spinning']:.3f}; whole stopped/spinning time {m['whole stopped']/m['whole spinning']:.3f}")

"""Page faults and context switches a one-token append costs, in the worker and in this client, the whole model
through one daemon (1 llama thread, direct channel): replies carrying the logits row against replies sampled greedy
in the worker. Run from a checkout. Usage: faults_probe.py MODEL STEPS"""
import os, pathlib, resource, sys, tempfile, time, contextlib, statistics
sys.path.insert(0, os.getcwd())
import psutil
from kvpool.launcher import Daemon
from kvpool.wire.sampling import Sampling
model = pathlib.Path(sys.argv[1]); steps = int(sys.argv[2])
def minflt(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])
opts = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1"]
with contextlib.ExitStack() as stack:
    d = Daemon(model, pathlib.Path(tempfile.mkdtemp(prefix="kvpool-fl-")) / "w.sock", opts)
    stack.callback(d.stop); d.wait_ready()
    c = stack.enter_context(d.client())
    c.append("s", 1, 0, tokens=list(range(200, 264)), n_ctx=1024); pos = 64
    worker = [k for k in psutil.Process(d.process.pid).children() if "spawn_main" in " ".join(k.cmdline())][0]
    for kind in ("logits", "sampled", "logits", "sampled"):
        for _ in range(5):  # settle
            c.append("s", 1, pos, tokens=[1000], sample=Sampling() if kind == "sampled" else None); pos += 1
        w0, r0, x0 = minflt(worker.pid), resource.getrusage(resource.RUSAGE_SELF), worker.num_ctx_switches()
        t = []
        for _ in range(steps):
            s = time.perf_counter()
            c.append("s", 1, pos, tokens=[1000], sample=Sampling() if kind == "sampled" else None); pos += 1
            t.append(time.perf_counter() - s)
        w1, r1, x1 = minflt(worker.pid), resource.getrusage(resource.RUSAGE_SELF), worker.num_ctx_switches()
        print(f"{os.getcwd()} {kind:8s} per step: worker minor faults {(w1 - w0) / steps:7.1f}, voluntary switches {(x1.voluntary - x0.voluntary) / steps:5.1f}; "
              f"client minor faults {(r1.ru_minflt - r0.ru_minflt) / steps:7.1f}, voluntary switches {(r1.ru_nvcsw - r0.ru_nvcsw) / steps:5.1f}; median {statistics.median(t) * 1e3:.3f} ms", flush=True)

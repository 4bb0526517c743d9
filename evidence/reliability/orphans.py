"""Start one daemon through kvpool.launcher in a child program, SIGKILL that program, see what is left."""
import glob, os, signal, subprocess, sys, tempfile, time
import psutil
shard = sorted(glob.glob("/work/main/.kvpool/shards/*/*layers-00-10.gguf"))[0]
program = """
import pathlib, sys, time
from kvpool.launcher import start_daemons
[daemon] = start_daemons([pathlib.Path(sys.argv[1])], pathlib.Path(sys.argv[2]), ["--threads", "1", "--n-ctx", "64", "--max-sessions", "2"])
print(daemon.process.pid, *daemon.worker_pids(), flush=True)
time.sleep(3600)
"""
child = subprocess.Popen([sys.executable, "-c", program, shard, tempfile.mkdtemp(prefix="orph", dir="/tmp")], stdout=subprocess.PIPE, text=True)
pids = [int(p) for p in child.stdout.readline().split()]
child.kill(); child.wait(); killed = time.monotonic()
def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
while any(alive(p) for p in pids) and time.monotonic() - killed < 10:
    time.sleep(0.05)
left = [p for p in pids if alive(p)]
print(f"SIGKILL of the launching program; after {time.monotonic() - killed:.2f} s still running: {len(left)} of {len(pids)} processes {left}")
for p in left:
    os.kill(p, signal.SIGKILL)

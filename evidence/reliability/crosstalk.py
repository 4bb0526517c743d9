"""The issue's cross-talk snippet, run against whichever kvpool is first on PYTHONPATH."""
import glob, pathlib, sys, tempfile
import kvpool
from kvpool.client import Client
from kvpool.launcher import start_daemons
print("kvpool from", pathlib.Path(kvpool.__file__).parent.parent)
shard = pathlib.Path(sorted(glob.glob("/work/main/.kvpool/shards/*/*layers-00-10.gguf"))[0])
run_dir = pathlib.Path(tempfile.mkdtemp(prefix="xt", dir="/tmp"))
[daemon] = start_daemons([shard], run_dir, ["--threads", "1", "--n-ctx", "2048", "--max-sessions", "2"])
try:
    c = Client(daemon.socket, timeout_s=0.05)
    try:
        c.append("A", 1, 0, tokens=list(range(100, 1100)), n_ctx=2048)
        print("A: no timeout (machine too fast for the snippet)")
    except TimeoutError as error:
        print("A: TimeoutError", error)
    if getattr(c, "_main", None) is not None and getattr(c._main, "sock", None) is not None:
        c._main.sock.settimeout(30)
    if hasattr(type(c), "timeout_s"):
        c.timeout_s = 30
    try:
        r = c.append("B", 1, 0, tokens=[1, 2, 3], n_ctx=2048)
        print("B: length", r.length, "rows", r.rows.shape)
    except Exception as error:
        print("B:", type(error).__name__, error)
finally:
    daemon.stop()

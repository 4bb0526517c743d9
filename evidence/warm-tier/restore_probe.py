"""One middle-shard daemon (n_ctx 2112, 2 workers, 1 thread): a 512-row session appended, parked, restored by
its next 1-row append, then one more (hot) append; 8 rounds, the first 2 left out. Prints each phase's times
and median as the client sees them. Extra arguments go to `kvpool serve`.
Usage: .venv/bin/python evidence/warm-tier/restore_probe.py"""

import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvpool.launcher import Daemon  # noqa: E402
from kvpool.shard.bundled import bundled_model_path  # noqa: E402
from kvpool.shard.cache import shards_in_parts  # noqa: E402
from workers.runtime.model import ShardModel  # noqa: E402

N_CTX, LENGTH = 2112, 512
print("GLIBC_TUNABLES =", os.environ.get("GLIBC_TUNABLES"))
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda s: None)
tokens = np.arange(100, 100 + LENGTH + 8, dtype=np.int32)
with ShardModel(shards[0].path, n_threads=1) as first, first.new_context(N_CTX) as context:
    hidden = context.append(0, tokens=tokens).copy()
sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
options = ["--ttl", "600", "--threads-per-worker", "1", "--threads", "1", "--max-sessions", "2",
           "--n-ctx", str(N_CTX), "--budget", "1GiB", "--spill-budget", "1GiB", *sys.argv[1:]]
daemon = Daemon(shards[1].path, sockets / "mid.sock", options)
try:
    daemon.wait_ready()
    with daemon.client() as client:
        rows = {"park": [], "restoring append": [], "hot append": []}
        for round_index in range(8):
            session = f"s{round_index}"
            client.append(session, 1, 0, hidden=hidden[:LENGTH])
            t0 = time.perf_counter()
            client.park(session, 1)
            t1 = time.perf_counter()
            assert client.append(session, 1, LENGTH, hidden=hidden[LENGTH : LENGTH + 1]).restored
            t2 = time.perf_counter()
            client.append(session, 1, LENGTH + 1, hidden=hidden[LENGTH + 1 : LENGTH + 2])
            t3 = time.perf_counter()
            client.release(session, 1)
            if round_index >= 2:
                for name, seconds in zip(rows, (t1 - t0, t2 - t1, t3 - t2)):
                    rows[name].append(seconds)
        for name, values in rows.items():
            print(f"{name}: ms", " ".join(f"{v * 1e3:.1f}" for v in values), f"median {statistics.median(values) * 1e3:.2f}")
        print({name: value for name, value in client.stats().counters.items() if name in ("restores", "spills", "misses")})
finally:
    daemon.stop()
    shutil.rmtree(sockets, ignore_errors=True)

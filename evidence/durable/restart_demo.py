"""A rolling restart by hand: daemon A (middle shard of the bundled model, --spill-dir) holds two sessions,
is drained with SIGTERM; an older-format file is planted beside its files; daemon B starts on the same
socket and spill dir, adopts, and a client's next append is restored bit-identically. Prints what it saw."""

import pathlib
import shutil
import signal
import sys
import tempfile

import numpy as np

from kvpool.client.client import Client
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.shard.bundled import bundled_model_path

middle = shards_in_parts(bundled_model_path(), 3)[1]
work = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-restart-"))
spill_dir, socket = work / "spill", work / "mid.sock"
options = ["--threads", "1", "--n-ctx", "256", "--max-sessions", "2", "--spill-dir", str(spill_dir), "--spill-disk-budget", "64MiB"]
rows = {name: np.random.default_rng(seed).standard_normal((count, middle.shape.n_embd)).astype(np.float32)
        for name, seed, count in (("a", 1, 9), ("b", 2, 5))}
step = np.random.default_rng(3).standard_normal((1, middle.shape.n_embd)).astype(np.float32)
try:
    old = Daemon(middle.path, socket, options)
    old.wait_ready()
    with Client(socket) as client:
        for name, prefix in rows.items():
            client.append(name, 1, 0, hidden=prefix)
        old.process.send_signal(signal.SIGTERM)
        print("daemon A exit code:", old.process.wait(300))
        print("A's log, drain lines:", *[line for line in old.log().splitlines() if "drain" in line], sep="\n  ")
        (spill_dir / "kvpool-00000077.kvstate").write_bytes(b"KVPSPIL1" + b"\0" * 64)
        print("files in the spill dir:", sorted(path.name for path in spill_dir.iterdir()))
        new = Daemon(middle.path, socket, options)
        new.wait_ready()
        print("B's log, adoption line:", *[line for line in new.log().splitlines() if "adopted" in line], sep="\n  ")
        print("B's sessions:", [(row.session_id, row.epoch, row.length, row.tier) for row in client.stats().sessions])
        for name, prefix in rows.items():
            continued = client.append(name, 1, len(prefix), hidden=step)
            client.append(f"ref-{name}", 1, 0, hidden=prefix)
            reference = client.append(f"ref-{name}", 1, len(prefix), hidden=step)
            print(f"{name}: restored={continued.restored} length={continued.length} bit-identical to a session never stopped: {np.array_equal(continued.rows, reference.rows)}")
        print("B's counters adopted:", client.stats().counters.get("adopted"), "integrity:", client.stats().integrity)
        new.stop()
    old.stop()
finally:
    shutil.rmtree(work, ignore_errors=True)

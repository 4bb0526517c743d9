"""In a mount namespace whose /dev/shm is a 64 MiB tmpfs (Docker's default): a whole-model daemon,
an all-rows prefill of 400 tokens (400 x 49152 float32 logits = 75 MiB), compared with llama.cpp in-process."""
import os, pathlib, tempfile
import numpy as np
from kvpool.bundled import bundled_model_path
from kvpool.client import Client, KvpoolError
from kvpool.launcher import start_daemons
from workers.runtime import ShardModel
st = os.statvfs("/dev/shm")
print(f"/dev/shm: {st.f_blocks * st.f_frsize / 2**20:.0f} MiB")
model = bundled_model_path()
tokens = [1 + (i * 37) % 40000 for i in range(400)]
with ShardModel(model, n_threads=1) as m, m.new_context(2048) as ctx:
    expected = np.array(ctx.append(0, tokens=np.array(tokens), output_rows="all"), copy=True)
[daemon] = start_daemons([model], pathlib.Path(tempfile.mkdtemp(prefix="shm", dir="/tmp")), ["--threads", "1", "--n-ctx", "2048", "--max-sessions", "2"])
try:
    with daemon.client() as client:
        try:
            rows = client.append("all-rows", 1, 0, tokens=tokens, output_rows="all").rows
            print(f"all-rows prefill: {rows.shape}, identical to in-process: {np.array_equal(rows, expected)}")
        except KvpoolError as error:
            print("all-rows prefill failed:", error)
        stats = client.stats()
        print(f"shared_memory_bytes in the books: {getattr(stats.budget, 'shared_memory_bytes', 'n/a')}; integrity {stats.integrity}")
finally:
    daemon.stop()

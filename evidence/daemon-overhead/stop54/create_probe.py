"""Stop 54: what does creating a context cost in a process like a worker (glibc's mmap threshold fixed at 128 KiB,
workers.server.main) against one left dynamic (the bench's reference process)? Creates a context of n_ctx N-k, appends
one token, closes it (and malloc_trim(0), as a worker does after freeing a context), ROUNDS times; prints medians.
Usage: create_probe.py MODEL N ROUNDS fixed|dynamic|dynamic-notrim (notrim: no malloc_trim after the close)"""
import ctypes, ctypes.util, os, pathlib, statistics, sys, time
sys.path.insert(0, "/tmp/dev54")
libc = ctypes.CDLL(ctypes.util.find_library("c"))
if "fixed" in sys.argv[4]:
    assert libc.mallopt(-3, 128 * 1024) == 1
import numpy as np
from workers.runtime.model import ShardModel

model = ShardModel(pathlib.Path(sys.argv[1]), n_threads=1)
n, rounds = int(sys.argv[2]), int(sys.argv[3])
create, append, close = [], [], []
for k in range(1, rounds + 1):
    t0 = time.perf_counter(); c = model.new_context(n - k); t1 = time.perf_counter()
    c.append(0, tokens=np.array([1], dtype=np.int32)); t2 = time.perf_counter()
    c.close(); (libc.malloc_trim(0) if "notrim" not in sys.argv[4] else None); t3 = time.perf_counter()
    create.append(t1 - t0); append.append(t2 - t1); close.append(t3 - t2)
med = lambda v: statistics.median(v) * 1e3
print(f"{sys.argv[4]:14s} n_ctx {n}-k: create {med(create):.2f} ms, first append {med(append):.2f} ms, close+trim {med(close):.2f} ms (rounds {rounds})")

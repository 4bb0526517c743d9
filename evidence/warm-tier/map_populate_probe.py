import mmap, os, time, statistics
import numpy as np
size = 3_940_000
fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
os.write(fd, os.urandom(size))
def t(f, n=50):
    xs = []
    for _ in range(n):
        s = time.perf_counter(); f(); xs.append((time.perf_counter() - s) * 1e3)
    return f"min {min(xs):.3f} med {statistics.median(xs):.3f}"
def pop_only():
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ); m.close()
def lazy_only():
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ); m.close()
dst = bytearray(size)
def pop_copy():
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ); dst[:] = m; m.close()
def lazy_copy():
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ); dst[:] = m; m.close()
for f in (pop_only, lazy_only, pop_copy, lazy_copy, pop_only, lazy_only, pop_copy, lazy_copy):
    print(f.__name__, t(f))

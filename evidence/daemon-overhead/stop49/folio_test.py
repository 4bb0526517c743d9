import os, sys, pathlib, ctypes, mmap
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel
model = pathlib.Path(sys.argv[1]); mode = sys.argv[2]
src = shards_in_parts(model, 3, progress=lambda line: None)[1].path
fd = os.open(src, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
libc = ctypes.CDLL(None, use_errno=True); libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int); libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
import time
t = time.perf_counter()
if mode == "touch":
    size = os.path.getsize(src); fd = os.open(src, os.O_RDONLY)
    addr = libc.mmap(None, size, 1, 1, fd, 0); os.close(fd)
    print("addr mod 2M", addr % (2 << 20), "madvise", libc.madvise(addr, size, 14))
    buf = (ctypes.c_char * size).from_address(addr)
    for off in range(0, size, 2 << 20): buf[off]
    libc.munmap(addr, size)
print("touch s", time.perf_counter() - t)
t = time.perf_counter()
m = ShardModel(src, n_threads=1)
print("load s", time.perf_counter() - t)
rss = pmd = 0; cur = None
for line in open("/proc/self/smaps"):
    p = line.split()
    if len(p) >= 5 and "-" in p[0] and ":" not in p[0]: cur = p[-1] if len(p) >= 6 else ""
    elif cur and cur.endswith(src.name):
        if p[0] == "Rss:": rss += int(p[1])
        if p[0] == "FilePmdMapped:": pmd += int(p[1])
print(mode, "Rss", rss, "FilePmdMapped", pmd)

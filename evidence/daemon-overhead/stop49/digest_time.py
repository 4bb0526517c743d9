import os, sys, time, pathlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from kvpool.shard.header import read_shard_info
from kvpool.shard.digests import verified_block_digests
p = pathlib.Path(sys.argv[1])
for i in range(2):
    fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
    t = time.perf_counter(); verified_block_digests(read_shard_info(p)); a = time.perf_counter() - t
    t = time.perf_counter(); verified_block_digests(read_shard_info(p)); b = time.perf_counter() - t
    print(f"cold {a:.3f} s, cached {b:.3f} s")

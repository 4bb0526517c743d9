import os, sys, pathlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
p = pathlib.Path(sys.argv[1]); variant = sys.argv[2]
fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
from kvpool.shard.header import read_shard_info
from workers.runtime.huge_pages import read_in_huge_folios
from workers.runtime.model import ShardModel
if "h" in variant: read_shard_info(p)
if "r" in variant: read_in_huge_folios(p)
m = ShardModel(p, n_threads=1, huge_pages=("n" not in variant)); print(variant, m.huge_pages.describe())

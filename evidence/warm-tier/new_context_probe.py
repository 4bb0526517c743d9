"""Time creating (and closing) a context of the middle bundled shard at several n_ctx, the allocator set as a
worker's (workers.server.main.fix_allocator). Run it under GLIBC_TUNABLES=glibc.malloc.hugetlb=1 and =0 to compare.
Usage: .venv/bin/python evidence/warm-tier/new_context_probe.py"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvpool.shard.bundled import bundled_model_path  # noqa: E402
from kvpool.shard.cache import shards_in_parts  # noqa: E402
from workers.runtime.model import ShardModel  # noqa: E402
from workers.server.main import fix_allocator  # noqa: E402

fix_allocator()
print("GLIBC_TUNABLES =", os.environ.get("GLIBC_TUNABLES"))
shards = shards_in_parts(bundled_model_path(), 3, progress=lambda s: None)
model = ShardModel(shards[1].path, n_threads=1)
for n_ctx in (512, 2112, 8192, 2112, 512):
    times = []
    for _ in range(5):
        started = time.perf_counter()
        context = model.new_context(n_ctx)
        times.append((time.perf_counter() - started) * 1e3)
        context.close()
    print(f"n_ctx {n_ctx}: new_context ms", " ".join(f"{t:.1f}" for t in times))

"""In process, the middle bundled shard at n_ctx 2112 with a session of N positions (default 512): the parts of a
save as workers.runtime.sequence_io did it before this stop (llama_state_seq_get_size, a zeroed bytearray,
llama_state_seq_get_data into it, a bytes() copy), as it does it now (an uninitialised bytes object filled by
llama.cpp), and a restore handed the buffer's address (no copy). Usage: .venv/bin/python evidence/warm-tier/save_parts_probe.py [N]"""
import ctypes
import sys
import time

import numpy as np

sys.path.insert(0, __import__('os').path.dirname(__import__('os').path.dirname(__import__('os').path.dirname(__import__('os').path.abspath(__file__)))))
import llama_cpp

from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
from workers.runtime.model import ShardModel
from workers.server.main import fix_allocator

fix_allocator()
shards = shards_in_parts(bundled_model_path(), 3, progress=print)
N = 2112; L = int(sys.argv[1]) if len(sys.argv) > 1 else 512
tokens = np.arange(100, 100 + L + 8, dtype=np.int32) % 40000
with ShardModel(shards[0].path, n_threads=1) as first, first.new_context(N) as c:
    hidden = c.append(0, tokens=tokens).copy()
m = ShardModel(shards[1].path, n_threads=1)
ctx = m.new_context(N); ctx.append(0, hidden=hidden[:L]); h = ctx._handle()
nb = ctypes.pythonapi.PyBytes_FromStringAndSize; nb.restype = ctypes.py_object; nb.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
for i in range(6):
    t0 = time.perf_counter(); size = llama_cpp.llama_state_seq_get_size(h, 0)
    t1 = time.perf_counter(); buf = bytearray(size)
    t2 = time.perf_counter(); llama_cpp.llama_state_seq_get_data(h, (ctypes.c_uint8 * size).from_buffer(buf), size, 0)
    t3 = time.perf_counter(); b = bytes(buf)
    t4 = time.perf_counter(); b2 = nb(None, size); llama_cpp.llama_state_seq_get_data(h, ctypes.cast(ctypes.c_char_p(b2), ctypes.POINTER(ctypes.c_uint8)), size, 0)
    t5 = time.perf_counter(); a = np.frombuffer(b2, np.uint8)
    ctx2 = m.new_context(N); t6 = time.perf_counter()
    ok = llama_cpp.llama_state_seq_set_data(ctx2._handle(), a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0)
    t7 = time.perf_counter(); ctx2.close()
    print(f"{size/2**20:.2f} MiB get_size {1e3*(t1-t0):.2f} bytearray {1e3*(t2-t1):.2f} get_data {1e3*(t3-t2):.2f} bytes() {1e3*(t4-t3):.2f} | uninit bytes+get_data {1e3*(t5-t4):.2f} | set_data zero-copy {1e3*(t7-t6):.2f} ok={ok} same={b==b2}")

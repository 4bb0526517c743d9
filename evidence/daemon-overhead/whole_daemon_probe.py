import sys, time, statistics, pathlib, subprocess, os
import numpy as np
from kvpool.client.client import Client
from workers.runtime.model import ShardModel
model = sys.argv[1]
sock = "/tmp/p43/w.sock"
d = subprocess.Popen([".venv/bin/kvpool", "serve", "--model", model, "--socket", sock, "--threads", "1", "--n-ctx", "1024", "--max-sessions", "1", "--calibration-cache", "off"] + sys.argv[2:], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
try:
    for _ in range(600):
        if os.path.exists(sock):
            try:
                c = Client(sock); break
            except Exception: pass
        time.sleep(0.2)
    st = c.stats()
    print("daemon:", st.huge_pages, [w.huge_page_bytes >> 20 for w in st.workers])
    m = ShardModel(model, n_threads=1)
    ctx = m.new_context(1024)
    toks = list(range(1, 129))
    ctx.append(0, tokens=np.array(toks, np.int32)); c.append("s", 1, 0, tokens=toks)
    ins, dae = [], []
    for r in range(4):
        for i in range(15):
            s = time.perf_counter(); ctx.append(128 + i, tokens=np.array([5 + i], np.int32)); ins.append(time.perf_counter() - s)
        for i in range(15):
            s = time.perf_counter(); c.append("s", 1, 128 + i, tokens=[5 + i]); dae.append(time.perf_counter() - s)
        ctx.truncate(128); c.truncate("s", 1, 128)
    print(f"in-process med {statistics.median(ins)*1e3:.2f}  daemon med {statistics.median(dae)*1e3:.2f}  ratio {statistics.median(ins)/statistics.median(dae):.3f}")
finally:
    d.terminate(); d.wait()

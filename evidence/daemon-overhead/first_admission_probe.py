import pathlib, sys, tempfile, time
from kvpool.launcher import Daemon
from kvpool.shard.bundled import bundled_model_path
setting = sys.argv[1]
out = []
for r in range(int(sys.argv[2])):
    d = Daemon(bundled_model_path(), pathlib.Path(tempfile.mkdtemp()) / "w.sock", ["--threads", "2", "--threads-per-worker", "1", "--max-sessions", "4", "--n-ctx", "8192", "--ttl", "600", "--huge-pages", setting, "--calibration-cache", "/tmp/first-admit-cal"])
    d.wait_ready()
    with d.client() as c:
        times = {}
        for i, n in enumerate((512, 2048, 2048)):
            s = time.perf_counter(); c.append(f"s{i}", 1, 0, tokens=[1], n_ctx=n); times[f"{n}#{i}"] = round((time.perf_counter() - s) * 1e3, 1)
            c.release(f"s{i}", 1)
        hp = sum(w.huge_page_bytes for w in c.stats().workers)
    d.stop()
    print(setting, times, "huge page bytes at ready", hp, flush=True)

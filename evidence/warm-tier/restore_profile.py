"""Where a parked session's restore goes, on one middle-shard daemon (n_ctx 2112, 512 tokens) and in process."""
import pathlib, statistics, sys, tempfile, time
import numpy as np
from kvpool.client.client import Client
from kvpool.launcher import Daemon
from kvpool.shard.cache import cached_shards
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.ranges import parse_splits
from workers.runtime.model import ShardModel
from workers.runtime.sequence_io import save_sequence, restore_sequence

shards = cached_shards(bundled_model_path(), parse_splits("0:10,10:20,20:30", 30), root=pathlib.Path(".kvpool/profile-shards"))
mid = shards[1]
N_CTX, LENGTH, ROUNDS = 2112, int(sys.argv[1]) if len(sys.argv) > 1 else 512, 7
rows = (np.random.default_rng(0).standard_normal((LENGTH + 2, mid.shape.n_embd)) * 0.1).astype(np.float32)

def ms(values): return f"min {min(values)*1e3:.1f} med {statistics.median(values)*1e3:.1f} max {max(values)*1e3:.1f} ms"
def t(f):
    s = time.perf_counter(); r = f(); return time.perf_counter() - s, r

with ShardModel(mid.path) as model:
    create, save, restore, decode, fresh_restore = [], [], [], [], []
    for _ in range(ROUNDS):
        dt, ctx = t(lambda: model.new_context(N_CTX)); create.append(dt)
        ctx.append(0, hidden=rows[:LENGTH])
        dt, blob = t(ctx.save_state); save.append(dt)
        ctx.close()
        dt, ctx2 = t(lambda: model.new_context(N_CTX))
        dt2, _ = t(lambda: ctx2.restore_state(blob, LENGTH)); restore.append(dt2); fresh_restore.append(dt + dt2)
        dt, _ = t(lambda: ctx2.append(LENGTH, hidden=rows[LENGTH:LENGTH + 1])); decode.append(dt)
        ctx2.close()
    print(f"in process: state {len(blob)/2**20:.2f} MiB; create n_ctx {N_CTX}: {ms(create)}; save: {ms(save)}; set_data+cut: {ms(restore)}; create+restore: {ms(fresh_restore)}; 1-row decode after: {ms(decode)}")

sockdir = pathlib.Path(tempfile.mkdtemp(prefix="kvp-")); sockdir.chmod(0o700)
daemon = Daemon(mid.path, sockdir / "mid.sock", ["--ttl", "600", "--threads", "1", "--max-sessions", "2", "--n-ctx", str(N_CTX),
                                                  "--budget", "1GiB", "--spill-budget", "1GiB", "--calibration-cache", ".kvpool/profile-calibration"])
try:
    daemon.wait_ready()
    for direct in (True, False):
        park, rest, hot, prefill = [], [], [], []
        with Client(daemon.socket, direct=direct) as c:
            for r in range(ROUNDS):
                sid = f"s{direct}{r}"
                dt, _ = t(lambda: c.append(sid, 1, 0, hidden=rows[:LENGTH])); prefill.append(dt)
                dt, _ = t(lambda: c.park(sid, 1)); park.append(dt)
                dt, res = t(lambda: c.append(sid, 1, LENGTH, hidden=rows[LENGTH:LENGTH + 1])); rest.append(dt)
                dt, _ = t(lambda: c.append(sid, 1, LENGTH + 1, hidden=rows[LENGTH + 1:LENGTH + 2])); hot.append(dt)
                c.release(sid, 1)
            restores = c.stats().counters["restores"]
        print(f"daemon direct={direct}: prefill {LENGTH}: {ms(prefill)}; park: {ms(park)}; restoring decode: {ms(rest)}; hot decode: {ms(hot)}; restores {restores}")
finally:
    daemon.stop()

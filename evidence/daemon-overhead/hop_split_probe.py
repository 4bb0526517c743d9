"""Hop split probe (stop 46): the ~1B model's three shard daemons (`--threads 1 --threads-per-worker 1 --n-ctx 1024
--max-sessions 1`), a Router session sampling greedy on the last (section 2's row of record), `steps` one-token steps
after a 128-token prompt and 10 warm-up steps; each step split by the client's clock (ClientConnection.send/receive
wrapped here) and every worker's (evidence/daemon-overhead/hop_timing_instrument.py applied to the tree for the run
only: marks in the direct channel's _serve/_append and around llama_decode). EXTRA_IDLE=N starts N more idle daemons
beside them. Usage: python hop_split_probe.py MODEL STEPS [daemon options]."""
import glob, json, os, pathlib, statistics, sys, tempfile, time, contextlib, collections
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from kvpool.launcher import Daemon
from kvpool.shard.cache import shards_in_parts
from kvpool.router.router import Router
from kvpool.wire.sampling import Sampling
import kvpool.client.connection as cc
model = pathlib.Path(sys.argv[1]); steps = int(sys.argv[2]); extra = sys.argv[3:]
shards = shards_in_parts(model, 3, progress=lambda line: None)
for old in glob.glob("/tmp/fine_times.*.json"): os.remove(old)
C = []
orig_send, orig_recv = cc.ClientConnection.send, cc.ClientConnection.receive
def send(self, m, rid=0):
    C.append(("s0", time.perf_counter())); r = orig_send(self, m, rid); C.append(("s1", time.perf_counter())); return r
def receive(self, rid):
    C.append(("r0", time.perf_counter())); r = orig_recv(self, rid); C.append(("r1", time.perf_counter())); return r
cc.ClientConnection.send, cc.ClientConnection.receive = send, receive
with contextlib.ExitStack() as stack:
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
    daemons = [Daemon(s.path, sockets / f"s{i}.sock", ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1", *extra]) for i, s in enumerate(shards)]
    idle = [Daemon(shards[i % 3].path, sockets / f"idle{i}.sock", ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "4"]) for i in range(int(os.environ.get("EXTRA_IDLE", "0")))]
    daemons_all = daemons + idle
    for d in daemons_all: stack.callback(d.stop)
    for d in daemons_all: d.wait_ready()
    clients = [stack.enter_context(d.client()) for d in daemons]
    sess = Router(clients).session("p", epoch=1)
    sess.sample(list(range(200, 328)), Sampling())
    for i in range(10): sess.sample([300 + i], Sampling())
    C.clear(); T = []
    for i in range(steps):
        s = time.perf_counter(); sess.sample([1000 + i], Sampling()); T.append((s, time.perf_counter(), list(C))); C.clear()
        time.sleep(0.0005) if False else None
files = [json.load(open(f)) for f in sorted(glob.glob("/tmp/fine_times.*.json"))]
files = [[m for m in f if len(m) == 11] for f in files]
files = [f for f in files if len(f) >= steps]
files.sort(key=lambda f: f[-1][0])
assert len(files) == 3, [len(f) for f in files]
W = [f[-steps:] for f in files]
parts = collections.defaultdict(list)
names = ["read frame+decode", "append_rows+check", "cancels.begin", "words+try", "compute lock", "context.append pre", "llama_decode", "post+finally", "reply made", "reply sent"]
for i, (t0, t1, c) in enumerate(T):
    sends = [t for k, t in c if k == "s1"]; s0s = [t for k, t in c if k == "s0"]; r1s = [t for k, t in c if k == "r1"]
    if len(sends) != 3 or len(r1s) != 3: continue
    parts["client: start -> hop0 send begun"].append(s0s[0] - t0)
    for h in range(3):
        m = W[h][i]
        parts[f"hop{h} client sent -> worker in _serve"].append(m[0] - sends[h])
        for k, n in enumerate(names):
            parts[f"hop{h} {n}"].append(m[k + 1] - m[k])
        parts[f"hop{h} worker sent -> client has reply"].append(r1s[h] - m[10])
        if h < 2: parts[f"hop{h} client: reply -> next send begun"].append(s0s[h + 1] - r1s[h])
    parts["client: last reply -> return"].append(t1 - r1s[2])
    parts["total"].append(t1 - t0)
    parts["outside llama_decode"].append((t1 - t0) - sum(W[h][i][7] - W[h][i][6] for h in range(3)))
for k, v in parts.items():
    print(f"{k:44s} med {statistics.median(v)*1e3:8.3f} ms")

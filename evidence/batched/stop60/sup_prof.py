"""Drive a daemon already listening at argv[1] with 4 batched sessions; then shut it down."""
import sys, time, threading, os
sys.path.insert(0, os.getcwd())
from kvpool.client.client import Client
from kvpool.wire.sampling import Sampling
sock = sys.argv[1]; STEPS = int(sys.argv[2])
for _ in range(600):
    try:
        Client(sock).close(); break
    except Exception:
        time.sleep(0.1)
clients = [Client(sock) for _ in range(4)]
prompts = [[1, 2, 3, 4, 5, 6, 7, 8][: 5 + i] for i in range(4)]
G = Sampling()
def sess(i):
    c = clients[i]; s = f"s-{i}"
    tok = c.append(s, 1, 0, tokens=prompts[i], n_ctx=1024, sample=G).token
    pos = len(prompts[i])
    for _ in range(STEPS):
        tok = c.append(s, 1, pos, tokens=[tok], sample=G).token; pos += 1
st = time.perf_counter()
ts = [threading.Thread(target=sess, args=(i,)) for i in range(4)]
for t in ts: t.start()
for t in ts: t.join()
print("tok/s", 4 * STEPS / (time.perf_counter() - st))
clients[0].shutdown()

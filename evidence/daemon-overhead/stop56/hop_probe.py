"""Stop 56: stop 53's forward probe (kept as it was below this line's paragraph) plus, for each way, every
process's CPU time, time waiting to run, and switches a step, from /proc/PID/task/*/schedstat read around each
turn (outside the timed steps): the client (this process), the probe's three workers, and kvpool's three
supervisors and their children (the workers, the resource tracker). Where kvpool's route spends its time over
the code-free relay. Usage as below; a third argument IDLE_S: also each process's CPU over IDLE_S seconds of
no requests at the end (the daemons' housekeeping).

How much a hop forwarding its rows to the next shard's process saves, at best: three processes, each with one
shard of the model loaded (1 llama thread, a kvpool ShardContext), minimal framing on Unix socketpairs (a 13-byte
header and the rows' bytes; no msgspec, no checks, no supervisor), in two ways on contexts of their own in the same
processes: relayed (the client sends to each process and gets its rows back, as kvpool's router does today) and
forwarded (each process sends its rows to the next, the last answers the client). The whole model in one context
in this process (the bench's PlainContext) is the reference. Turns of 5 one-token steps in rotation, each turn's
first left out; the last shard picks the token (argmax) in both ways, as the reference here.
Usage: forward_probe.py MODEL ROUNDS"""
import contextlib, pathlib, select, tempfile, socket, statistics, struct, subprocess, sys, time
sys.path.insert(0, "/work/main")
import numpy as np

HEAD = struct.Struct("<BIII")  # way (0 relayed, 1 forwarded, +2: a prompt, every row out), position, rows, bytes
PROMPT = np.arange(200, 328, dtype=np.int32)


def recv_exact(sock, n):
    buf = bytearray(n); view = memoryview(buf); got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return buf


def send(sock, way, pos, rows, payload):
    sock.sendall(HEAD.pack(way, pos, rows, len(payload)) + payload)


def schedstat(pid):
    """CPU ns, run-queue wait ns, timeslices: the sums over `pid`'s threads."""
    total = [0, 0, 0]
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue
        for i in range(3):
            total[i] += int(fields[i])
    return total


def worker(shard_path, client_fd, prev_fd, next_fd):
    from workers.runtime.model import ShardModel
    model = ShardModel(pathlib.Path(shard_path), n_threads=1)
    shape = model.shape
    contexts = [model.new_context(1024), model.new_context(1024)]
    client = socket.socket(fileno=client_fd)
    prev = socket.socket(fileno=prev_fd) if prev_fd >= 0 else None
    nxt = socket.socket(fileno=next_fd) if next_fd >= 0 else None
    sources = [client] + ([prev] if prev is not None else [])
    client.sendall(b"R")
    spent = ([], [])
    try:
        serve(shape, contexts, client, sources, nxt, spent)
    finally:
        print(f"shard {shape.layer_start}-{shape.layer_stop}: append med relayed {statistics.median(spent[0]) * 1e3:.3f} ms, "
              f"forwarded {statistics.median(spent[1]) * 1e3:.3f} ms", file=sys.stderr)


def serve(shape, contexts, client, sources, nxt, spent):
    while True:
        ready, _, _ = select.select(sources, [], [])
        for sock in ready:
            try:
                way, pos, count, size = HEAD.unpack(recv_exact(sock, HEAD.size))
            except EOFError:
                return
            data = recv_exact(sock, size)
            prompt, way = way >= 2, way % 2
            output_rows = "all" if prompt and not shape.is_last else "last"
            began = time.perf_counter()
            if shape.is_first:
                out = contexts[way].append(pos, tokens=np.frombuffer(data, dtype=np.int32), output_rows=output_rows)
            else:
                rows = np.frombuffer(data, dtype=np.float32).reshape(count, shape.n_embd)
                out = contexts[way].append(pos, hidden=rows, output_rows=output_rows)
            if not prompt:
                spent[way].append(time.perf_counter() - began)
            payload = np.int32(int(np.argmax(out[-1]))).tobytes() if shape.is_last else out.tobytes()
            rows_out = 1 if shape.is_last else out.shape[0]
            if way == 1 and nxt is not None:
                send(nxt, way + (2 if prompt else 0), pos, rows_out, payload)
            else:
                send(client, way, pos, rows_out, payload)


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    model_path = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2])
    with contextlib.ExitStack() as stack:
        run(model_path, rounds, stack)


def run(model_path, rounds, stack):
    from workers.runtime.model import ShardModel
    from kvpool.bench.reference import PlainContext
    from kvpool.shard.cache import shards_in_parts
    shards = shards_in_parts(model_path, 3, progress=lambda line: None)
    pairs = [socket.socketpair() for _ in range(3)]
    links = [socket.socketpair() for _ in range(2)]
    procs = []
    for k, shard in enumerate(shards):
        prev_fd = links[k - 1][1].fileno() if k > 0 else -1
        next_fd = links[k][0].fileno() if k < 2 else -1
        fds = [pairs[k][1].fileno()] + [fd for fd in (prev_fd, next_fd) if fd >= 0]
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(shard.path), str(pairs[k][1].fileno()),
                                       str(prev_fd), str(next_fd)], pass_fds=fds))
    client = [a for a, _ in pairs]
    for _, b in pairs: b.close()
    for a, b in links: a.close(); b.close()
    for s in client:
        assert recv_exact(s, 1) == b"R"
    from kvpool.launcher import Daemon
    from kvpool.router.router import Router
    from kvpool.wire.sampling import Sampling
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-fwd-"))
    options = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", "1024", "--max-sessions", "1"]
    daemons = [Daemon(shard.path, sockets / f"s{k}.sock", options) for k, shard in enumerate(shards)]
    for d in daemons:
        stack.callback(d.stop)
    for d in daemons:
        d.wait_ready()
    import os, psutil
    groups = {"client": [os.getpid()], "probe workers": [p.pid for p in procs], "supervisors": [d.process.pid for d in daemons]}
    groups["daemon workers"] = [pid for d in daemons for pid in d.worker_pids() if "resource_tracker" not in " ".join(psutil.Process(pid).cmdline())]
    groups["trackers"] = [pid for d in daemons for pid in d.worker_pids() if pid not in groups["daemon workers"]]
    print("pids:", groups)

    def read_all():
        return {g: [schedstat(pid) for pid in pids] for g, pids in groups.items()}

    spent = {}  # way -> group -> [cpu, wait, slices] summed over the timed steps (each turn's 2nd-5th)
    route = Router([stack.enter_context(d.client()) for d in daemons]).session("probe", epoch=1)
    route.sample([int(t) for t in PROMPT], Sampling())
    plain = PlainContext(ShardModel(model_path, n_threads=1), 1024, n_threads=1)
    plain.append(0, PROMPT)
    local = [ShardModel(shard.path, n_threads=1).new_context(1024) for shard in shards]
    rows = PROMPT
    for c in local:
        rows = c.append(0, tokens=rows, output_rows="all") if c.shape.is_first else c.append(0, hidden=rows, output_rows="all" if not c.shape.is_last else "last")
    local_spent = [[], [], []]

    def reply(sock):
        way, pos, count, size = HEAD.unpack(recv_exact(sock, HEAD.size))
        return count, recv_exact(sock, size)

    payload, count = PROMPT.tobytes(), len(PROMPT)  # the prompt, relayed: the client carries each hop's rows
    for s in client:
        send(s, 2, 0, count, payload); count, payload = reply(s); payload = bytes(payload)
    send(client[0], 3, 0, len(PROMPT), PROMPT.tobytes()); reply(client[2])  # and forwarded

    def relayed(pos, token):
        payload = np.int32(token).tobytes()
        for s in client:
            send(s, 0, pos, 1, payload); payload = bytes(reply(s)[1])
        return int(np.frombuffer(payload, dtype=np.int32)[0])

    def forwarded(pos, token):
        send(client[0], 1, pos, 1, np.int32(token).tobytes())
        return int(np.frombuffer(reply(client[2])[1], dtype=np.int32)[0])

    def whole(pos, token):
        return int(np.argmax(plain.append(pos, np.array([token], dtype=np.int32))))

    def in_process(pos, token):
        rows = np.array([token], dtype=np.int32)
        for k, c in enumerate(local):
            began = time.perf_counter()
            rows = c.append(pos, tokens=rows) if k == 0 else c.append(pos, hidden=rows)
            local_spent[k].append(time.perf_counter() - began)
        return int(np.argmax(rows[-1]))

    def kvpool_route(pos, token):
        return route.sample([token], Sampling()).token

    ways = {"whole": whole, "local": in_process, "relayed": relayed, "forwarded": forwarded, "kvpool": kvpool_route}
    times = {name: [] for name in ways}; picks = {name: [] for name in ways}
    pos = {name: len(PROMPT) for name in ways}
    for r in range(rounds):
        for name, step in ways.items():
            for i in range(5):
                token = 1000 + r * 5 + i
                if i == 1:
                    before = read_all()
                s = time.perf_counter(); pick = step(pos[name], token); e = time.perf_counter()
                pos[name] += 1
                if i:
                    times[name].append(e - s)
                picks[name].append(pick)
            after = read_all()
            way_spent = spent.setdefault(name, {g: [0, 0, 0] for g in groups})
            for g in groups:
                for b, a in zip(before[g], after[g]):
                    for k in range(3):
                        way_spent[g][k] += a[k] - b[k]
        if pos["whole"] > 1000:
            break
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    for name, v in times.items():
        print(f"{name:10s} med {med[name]:.3f} ms  min {min(v) * 1e3:.3f}  max {max(v) * 1e3:.3f}  steps {len(v)}")
    print("in this process, append med by shard:", " ".join(f"{statistics.median(v) * 1e3:.3f}" for v in local_spent), "ms")
    print(f"speed against the whole model: local {med['whole'] / med['local']:.4f}  kvpool's route {med['whole'] / med['kvpool']:.4f}  relayed {med['whole'] / med['relayed']:.4f}  forwarded {med['whole'] / med['forwarded']:.4f};"
          f"  forwarding saves {med['relayed'] - med['forwarded']:.3f} ms a step")
    print("a step, by process group (CPU ms / ms waiting to run / timeslices), means over the timed steps:")
    for name in ways:
        n = len(times[name])
        print(f"  {name:10s}", "  ".join(f"{g} {v[0] / n / 1e6:.3f}/{v[1] / n / 1e6:.3f}/{v[2] / n:.1f}" for g, v in spent[name].items()))
    print("the same tokens picked five ways:", picks["relayed"] == picks["forwarded"] == picks["whole"] == picks["local"] == picks["kvpool"])
    if len(sys.argv) > 3:
        idle_s = float(sys.argv[3]); before = read_all(); time.sleep(idle_s); after = read_all()
        print(f"idle {idle_s:.0f} s, CPU ms a second by process:", {g: [round((a[0] - b[0]) / idle_s / 1e6, 3) for b, a in zip(before[g], after[g])] for g in groups})
    for s in client:
        s.close()
    for p in procs:
        p.wait(timeout=60)


if __name__ == "__main__":
    main()

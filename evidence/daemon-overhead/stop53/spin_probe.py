"""Would a worker that spins, waiting for its next step, instead of blocking keep its compute at one process's
speed? The minimal three-process chain of forward_probe.py (a 13-byte header and the rows' bytes on Unix
socketpairs, a kvpool ShardContext a process, 1 llama thread), relayed through this process, in four ways on
contexts of their own in the same processes: blocking (each worker blocks in select between steps, as kvpool's do),
spinning (after each step a worker polls its sockets at SCHED_IDLE for up to SPIN_S, back to SCHED_OTHER once a
request is there), spinning at its own priority, and the whole model in this process as the reference. Turns of 5
one-token steps in rotation, each turn's first left out. Usage: spin_probe.py MODEL ROUNDS"""
import os, pathlib, select, socket, statistics, struct, subprocess, sys, time
sys.path.insert(0, "/work/main")
import numpy as np

HEAD = struct.Struct("<BIII")  # way (| PROMPT_FLAG: a prompt, every row out), position, rows, bytes
PROMPT_FLAG = 0x80
PROMPT = np.arange(200, 328, dtype=np.int32)
WAYS = ("blocking", "spin idle-class", "spin own priority")
SPIN_S = 0.1


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


def worker(shard_path, client_fd):
    from workers.runtime.model import ShardModel
    model = ShardModel(pathlib.Path(shard_path), n_threads=1)
    shape = model.shape
    contexts = [model.new_context(1024) for _ in WAYS]
    client = socket.socket(fileno=client_fd)
    client.sendall(b"R")
    spent = [[] for _ in WAYS]
    other, idle = os.sched_param(0), os.sched_param(0)
    try:
        while True:
            try:
                way, pos, count, size = HEAD.unpack(recv_exact(client, HEAD.size))
            except EOFError:
                return
            data = recv_exact(client, size)
            prompt, way = bool(way & PROMPT_FLAG), way & ~PROMPT_FLAG
            output_rows = "all" if prompt and not shape.is_last else "last"
            began = time.perf_counter()
            if shape.is_first:
                out = contexts[way].append(pos, tokens=np.frombuffer(data, dtype=np.int32), output_rows=output_rows)
            else:
                out = contexts[way].append(pos, hidden=np.frombuffer(data, dtype=np.float32).reshape(count, shape.n_embd), output_rows=output_rows)
            if not prompt:
                spent[way].append(time.perf_counter() - began)
            payload = np.int32(int(np.argmax(out[-1]))).tobytes() if shape.is_last else out.tobytes()
            send(client, way, pos, 1 if shape.is_last else out.shape[0], payload)
            if way and not prompt:  # spin for the next request
                if way == 1:
                    os.sched_setscheduler(0, os.SCHED_IDLE, idle)
                end = time.perf_counter() + SPIN_S
                while time.perf_counter() < end and not select.select([client], [], [], 0)[0]:
                    pass
                if way == 1:
                    os.sched_setscheduler(0, os.SCHED_OTHER, other)
    finally:
        print(f"shard {shape.layer_start}-{shape.layer_stop}: append med " + ", ".join(
            f"{name} {statistics.median(v) * 1e3:.3f} ms" for name, v in zip(WAYS, spent) if v), file=sys.stderr)


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
        return
    model_path = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2])
    from workers.runtime.model import ShardModel
    from kvpool.bench.reference import PlainContext
    from kvpool.shard.cache import shards_in_parts
    shards = shards_in_parts(model_path, 3, progress=lambda line: None)
    pairs = [socket.socketpair() for _ in range(3)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(shard.path), str(pairs[k][1].fileno())], pass_fds=[pairs[k][1].fileno()])
             for k, shard in enumerate(shards)]
    client = [a for a, _ in pairs]
    for _, b in pairs:
        b.close()
    for s in client:
        assert recv_exact(s, 1) == b"R"
    plain = PlainContext(ShardModel(model_path, n_threads=1), 1024, n_threads=1)
    plain.append(0, PROMPT)

    def reply(sock):
        way, pos, count, size = HEAD.unpack(recv_exact(sock, HEAD.size))
        return count, recv_exact(sock, size)

    for way in range(len(WAYS)):
        payload, count = PROMPT.tobytes(), len(PROMPT)
        for s in client:
            send(s, way | PROMPT_FLAG, 0, count, payload); count, payload = reply(s); payload = bytes(payload)

    def chain(way):
        def step(pos, token):
            payload = np.int32(token).tobytes()
            for s in client:
                send(s, way, pos, 1, payload); payload = bytes(reply(s)[1])
            return int(np.frombuffer(payload, dtype=np.int32)[0])
        return step

    def whole(pos, token):
        return int(np.argmax(plain.append(pos, np.array([token], dtype=np.int32))))

    ways = {"whole": whole, **{name: chain(way) for way, name in enumerate(WAYS)}}
    times = {name: [] for name in ways}; picks = {name: [] for name in ways}
    pos = {name: len(PROMPT) for name in ways}
    for r in range(rounds):
        for name, step in ways.items():
            for i in range(5):
                token = 1000 + r * 5 + i
                s = time.perf_counter(); pick = step(pos[name], token); e = time.perf_counter()
                pos[name] += 1
                if i:
                    times[name].append(e - s)
                picks[name].append(pick)
        if pos["whole"] > 1000:
            break
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    for name, v in times.items():
        print(f"{name:18s} med {med[name]:.3f} ms  min {min(v) * 1e3:.3f}  max {max(v) * 1e3:.3f}  steps {len(v)}  speed against the whole {med['whole'] / med[name]:.4f}")
    print("the same tokens picked every way:", all(picks[name] == picks["whole"] for name in ways))
    for s in client:
        s.close()
    for p in procs:
        p.wait(timeout=60)


if __name__ == "__main__":
    main()

"""A 3.76 MiB blob through a multiprocessing pipe with msgspec, as the supervisor sends RestoreState and reads Saved."""
import multiprocessing as mp, statistics, time
import msgspec

class Msg(msgspec.Struct):
    blob: bytes
    n: int = 0

def child(conn):
    dec = msgspec.msgpack.Decoder(Msg); enc = msgspec.msgpack.Encoder()
    while True:
        data = conn.recv_bytes()
        if not data: break
        m = dec.decode(data)
        conn.send_bytes(enc.encode(Msg(b"", len(m.blob))))  # small reply
        # then a big reply, as Saved
        conn.send_bytes(enc.encode(m))

if __name__ == "__main__":
    mp.set_start_method("spawn")
    a, b = mp.Pipe()
    p = mp.Process(target=child, args=(b,)); p.start()
    enc = msgspec.msgpack.Encoder(); dec = msgspec.msgpack.Decoder(Msg)
    blob = bytes(3_940_000)
    to_worker, from_worker = [], []
    for _ in range(15):
        s = time.perf_counter(); a.send_bytes(enc.encode(Msg(blob))); a.recv_bytes(); to_worker.append(time.perf_counter() - s)
        s = time.perf_counter(); dec.decode(a.recv_bytes()); from_worker.append(time.perf_counter() - s)
    a.send_bytes(b""); p.join()
    f = lambda v: f"min {min(v)*1e3:.2f} med {statistics.median(v)*1e3:.2f} max {max(v)*1e3:.2f} ms"
    print(f"3.76 MiB to a worker and a small reply: {f(to_worker)}; 3.76 MiB back from it: {f(from_worker)}")

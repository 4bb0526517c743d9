"""Stop 54: three sessions decoding while a fourth prefills again and again, on one whole-model daemon (process mode,
4 workers, --threads 2 --threads-per-worker 1: at most 2 compute at once, bounded by the compute locks), from the
checkout in the current directory. Each decoder's step latency (client side, greedy on the daemon, direct channel):
a decode that waits for a slot while the other slot frees between other steps shows as a step as long as a prefill.
Usage: mixed_probe.py MODEL SECONDS PREFILL_ROWS"""
import os, pathlib, statistics, sys, tempfile, threading, time
sys.path.insert(0, os.getcwd())
from kvpool.bench.parallel import GREEDY
from kvpool.launcher import Daemon

model = pathlib.Path(sys.argv[1]); seconds = float(sys.argv[2]); rows = int(sys.argv[3])

with tempfile.TemporaryDirectory(prefix="p54-") as directory:
    daemon = Daemon(model, pathlib.Path(directory) / "whole.sock", ["--ttl", "600", "--keep-warm", "1", "--threads", "2", "--threads-per-worker", "1",
                    "--max-sessions", "4", "--n-ctx", "2048", "--budget", "2GiB", "--spill-budget", "0", "--min-residency", "0"])
    try:
        daemon.wait_ready()
        stop = time.monotonic() + seconds
        steps = {name: [] for name in ("b", "c", "d")}
        prefills = []

        def decoder(name):
            with daemon.client() as client:
                token = client.append(name, 1, 0, tokens=[1, 200, 300, 400], n_ctx=2048, sample=GREEDY).token
                position = 4
                while time.monotonic() < stop and position < 2000:
                    began = time.perf_counter()
                    token = client.append(name, 1, position, tokens=[token], sample=GREEDY).token
                    steps[name].append(time.perf_counter() - began)
                    position += 1

        def prefiller():
            with daemon.client() as client:
                k = 0
                while time.monotonic() < stop:
                    began = time.perf_counter()
                    client.append(f"a{k}", 1, 0, tokens=[1] + [100 + (i * 7) % 5000 for i in range(rows - 1)], n_ctx=2048, sample=GREEDY)
                    prefills.append(time.perf_counter() - began)
                    client.release(f"a{k}", 1)
                    k += 1

        threads = [threading.Thread(target=decoder, args=(name,)) for name in steps] + [threading.Thread(target=prefiller)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        every = sorted(v for values in steps.values() for v in values)
        med = statistics.median(every)
        q = lambda f: every[min(len(every) - 1, int(f * len(every)))]
        print(f"{os.getcwd()}: decode steps {len(every)}, median {med * 1e3:.1f} ms, p90 {q(0.9) * 1e3:.1f}, p99 {q(0.99) * 1e3:.1f}, max {every[-1] * 1e3:.1f}; "
              f"steps over 3x the median {sum(v > 3 * med for v in every)}; prefills {len(prefills)} of {rows} rows, median {statistics.median(prefills) * 1e3:.1f} ms; "
              f"decode tok/s {len(every) / seconds:.1f}")
    finally:
        daemon.stop()

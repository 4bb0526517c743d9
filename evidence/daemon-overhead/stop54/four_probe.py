"""Stop 54: four sessions on one whole-model daemon (process mode, 4 workers, --threads 2 --threads-per-worker 1: at
most 2 compute at once, bounded by the compute locks), as the bench's section 3 runs them (kvpool.bench.parallel:
one thread a session, greedy on the daemon, the direct channel), from the checkout in the current directory.
Prints each round's aggregate decode tok/s and the CPUs' idle share during it (/proc/stat).
Usage: four_probe.py MODEL ROUNDS STEPS"""
import os, pathlib, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
from kvpool.bench.parallel import _parallel_kvpool, _whole_appender
from kvpool.launcher import Daemon

model = pathlib.Path(sys.argv[1]); rounds = int(sys.argv[2]); steps = int(sys.argv[3])


def cpu_times():
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait, all


with tempfile.TemporaryDirectory(prefix="p54-") as directory:
    daemon = Daemon(model, pathlib.Path(directory) / "whole.sock", ["--ttl", "600", "--keep-warm", "1", "--threads", "2", "--threads-per-worker", "1",
                    "--max-sessions", "4", "--n-ctx", "1024", "--budget", "2GiB", "--spill-budget", "0", "--min-residency", "0"])
    try:
        daemon.wait_ready()
        clients = [daemon.client() for _ in range(4)]
        prompts = [[1] + [100 + 7 * i + k for k in range(40)] for i in range(4)]
        rates, idles = [], []
        for r in range(rounds):
            appenders = [_whole_appender(client, f"s{r}-{i}") for i, client in enumerate(clients)]
            marks = {}
            rate = _parallel_kvpool(appenders, prompts, steps, on_start=lambda: marks.__setitem__("a", cpu_times()), on_end=lambda: marks.__setitem__("b", cpu_times()))
            idle = (marks["b"][0] - marks["a"][0]) / max(1, marks["b"][1] - marks["a"][1])
            rates.append(rate); idles.append(idle)
            for i, client in enumerate(clients):
                client.release(f"s{r}-{i}", 1)
            print(f"round {r}: {rate:.2f} tok/s, CPUs idle {idle:.3f}", flush=True)
        print(f"{os.getcwd()}: median {statistics.median(rates):.2f} tok/s (min {min(rates):.2f} max {max(rates):.2f}), idle median {statistics.median(idles):.3f}")
        for client in clients:
            client.close()
    finally:
        daemon.stop()

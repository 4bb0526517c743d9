"""Probe (issue 29, item 4): where the middle shard's per-token cost through a daemon goes, against the same
shard in process. Each configuration's decode steps are timed in blocks of their own (not interleaved with
another variant), after a prefill of --history rows, for --rounds rounds of --steps steps:

  runtime          the worker runtime in this process (1 thread)
  daemon           a middle-shard daemon (--threads 1 --max-sessions 1), its supervisor's defaults
  daemon, no hk    the same with --housekeeping-interval 3600 (no housekeeping pass while it is timed)

--neighbours N starts N idle whole-model daemons beside them (4 workers each; --neighbour-housekeeping S), as the
bench's other daemons sit idle beside section 1. Prints one line per round (min / median / max ms per step)
and a summary; `--json PATH` writes the raw step times.

    python scripts/probe_daemon_overhead.py [--model PATH] [--neighbours 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvpool.launcher import Daemon  # noqa: E402
from kvpool.shard.bundled import bundled_model_path  # noqa: E402
from kvpool.shard.cache import shards_in_parts  # noqa: E402
from workers.runtime.model import ShardModel  # noqa: E402

N_CTX = 1024


def say(line: str) -> None:
    print(f"probe: {time.strftime('%H:%M:%S')} {line}", flush=True)


def timed_steps(reset, append, hidden: np.ndarray, history: int, steps: int) -> list[float]:
    reset()
    append(0, hidden[:history])
    times = []
    for step in range(steps):
        row = hidden[history + step : history + step + 1]
        started = time.perf_counter()
        append(history + step, row)
        times.append(time.perf_counter() - started)
    return times


def spread(values: list[float]) -> str:
    ms = [v * 1e3 for v in values]
    return f"min {min(ms):.2f} / median {statistics.median(ms):.2f} / max {max(ms):.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, default=None, help="a llama GGUF (default: the bundled model)")
    parser.add_argument("--history", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbours", type=int, default=0, help="idle whole-model daemons beside (default 0)")
    parser.add_argument("--neighbour-housekeeping", type=float, default=0.5, help="their --housekeeping-interval (default 0.5, serve's)")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()
    source = args.model or bundled_model_path()
    shards = shards_in_parts(source, 3, progress=say)
    middle = shards[1]
    say(f"model {source.name}, middle shard {middle.path.name}, cpu {platform.processor() or platform.machine()}, {os.cpu_count()} cpus")
    tokens = np.arange(100, 100 + args.history + args.steps + 8, dtype=np.int32)
    with ShardModel(shards[0].path, n_threads=1) as first, first.new_context(N_CTX) as context:
        hidden = context.append(0, tokens=tokens).copy()
    results: dict[str, list[list[float]]] = {}
    with contextlib.ExitStack() as stack:
        sockets = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-probe-"))
        common = ["--ttl", "600", "--threads", "1", "--threads-per-worker", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1"]
        daemons = {
            "daemon": Daemon(middle.path, sockets / "mid.sock", common),
            "daemon, no hk": Daemon(middle.path, sockets / "midq.sock", [*common, "--housekeeping-interval", "3600"]),
        }
        for index in range(args.neighbours):
            daemons[f"neighbour {index}"] = Daemon(source, sockets / f"n{index}.sock", ["--ttl", "600", "--threads", "2", "--threads-per-worker", "1", "--max-sessions", "4", "--n-ctx", "2048",
                                                                                 "--housekeeping-interval", str(args.neighbour_housekeeping)])
        for daemon in daemons.values():
            stack.callback(daemon.stop)
        for daemon in daemons.values():
            daemon.wait_ready()
        say(f"{len(daemons)} daemons ready")
        model = stack.enter_context(ShardModel(middle.path, n_threads=1))
        runtime = stack.enter_context(model.new_context(N_CTX))
        variants = {"runtime": (lambda: runtime.truncate(0), lambda start, rows: runtime.append(start, hidden=rows))}
        for name in ("daemon", "daemon, no hk"):
            client = stack.enter_context(daemons[name].client())
            session = f"probe-{name}"
            client.append(session, 1, 0, hidden=hidden[:1])

            def reset(client=client, session=session) -> None:
                client.truncate(session, 1, 0)

            def append(start, rows, client=client, session=session) -> None:
                client.append(session, 1, start, hidden=rows)

            variants[name] = (reset, append)
        for name, (reset, append) in variants.items():  # warm-up
            timed_steps(reset, append, hidden, args.history, 4)
        for round_index in range(args.rounds):
            for name, (reset, append) in variants.items():
                times = timed_steps(reset, append, hidden, args.history, args.steps)
                results.setdefault(name, []).append(times)
                say(f"round {round_index + 1}: {name:14s} {spread(times)}; first 6 steps {' '.join(f'{t * 1e3:.1f}' for t in times[:6])}")
    print("summary (all rounds, ms per step):")
    runtime_median = statistics.median(t for times in results["runtime"] for t in times)
    for name, rounds in results.items():
        flat = [t for times in rounds for t in times]
        print(f"  {name:14s} {spread(flat)}; runtime median / this median {runtime_median / statistics.median(flat):.3f}x")
    if args.json:
        args.json.write_text(json.dumps({"model": str(source), "middle": str(middle.path), "steps_s": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

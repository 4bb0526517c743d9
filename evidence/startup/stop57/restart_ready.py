"""A restart's readiness, stage by stage: start `kvpool serve --log-format json` on SHARD at N_CTX with the
calibration cache CACHE (filled by an earlier start: a restart), wait for its socket to answer, stop it; print
the time to the first answer and each log line at its own timestamp, both from the launch. ROUNDS rounds."""
import datetime
import json
import pathlib
import subprocess
import sys
import threading
import time

from kvpool.launcher import not_answering

shard, n_ctx, cache, rounds = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
work = pathlib.Path(sys.argv[5] if len(sys.argv) > 5 else "/tmp/restart-ready")
work.mkdir(parents=True, exist_ok=True)
for round_ in range(rounds):
    socket = work / f"r{round_}.sock"
    launched = time.time()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "serve", "--model", str(shard), "--socket", str(socket), "--n-ctx", n_ctx,
         "--threads", "1", "--max-sessions", "1", "--spill-budget", "0", "--calibration-cache", cache, "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    while not_answering(socket) is not None:
        if process.poll() is not None:
            sys.exit(f"the daemon exited: {''.join(lines)[-2000:]}")
        time.sleep(0.01)
    ready = time.time() - launched
    process.terminate()
    process.wait()
    reader.join(2)
    print(f"round {round_}: answered {ready:.3f} s after the launch")
    for line in lines:
        record = json.loads(line)
        at = datetime.datetime.fromisoformat(record["time"]).timestamp() - launched
        if at <= ready:
            print(f"  +{at:6.3f} s {record['message'][:100]}")

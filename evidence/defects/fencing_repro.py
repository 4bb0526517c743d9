"""Issue 17, items 1 and 2, reproduced against real daemons (run with the code under test first on PYTHONPATH).

    python evidence/defects/fencing_repro.py            # prints what each request was answered

Scenario 1: one place; Append(B, 1, 0) waits in the admission line; Release(B, 2) is answered; the place frees.
Scenario 2: X reaches epoch 5 and is released; 65,536 other ids are released (the table's old bound); Append(X, 3, 0).
Uses only what both the old and the new daemon speak (no new flags).
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import sys
import tempfile
import threading
import time

from kvpool.bundled import bundled_model_path
from kvpool.client import KvpoolError
from kvpool.launcher import Daemon
from kvpool.layer_ranges import parse_splits
from kvpool.protocol import PROTOCOL_VERSION, Append, Hello, Release, decode_reply, encode
from kvpool.shardcache import cached_shards

TOKENS = [1, 4093, 198, 28, 30, 2, 17, 9, 11, 13]


def answer(call) -> str:
    try:
        reply = call()
    except KvpoolError as error:
        return f"{error.code}" + (f" (reason {error.reason})" if error.reason else "") + f" length={error.length}"
    return f"ok length={getattr(reply, 'length', '?')}" + (f" admitted={reply.admitted}" if hasattr(reply, "admitted") else "") + (
        f" detail={reply.detail!r}" if hasattr(reply, "detail") else "")


def read_frame(sock: socket.socket):
    header = b""
    while len(header) < 4:
        header += sock.recv(4 - len(header))
    size = int.from_bytes(header, "big")
    payload = b""
    while len(payload) < size:
        payload += sock.recv(size - len(payload))
    return decode_reply(payload)


def scenario_admission(shard: pathlib.Path, run_dir: pathlib.Path) -> None:
    print("== scenario 1: an epoch-1 admission waits while Release(B, 2) is answered")
    daemon = Daemon(shard, run_dir / "s1.sock", ("--threads", "1", "--n-ctx", "64", "--max-sessions", "1", "--spill-budget", "0"))
    daemon.wait_ready(timeout_s=600)
    try:
        with daemon.client(direct=False) as client, daemon.client(direct=False) as other:
            client.append("holder", 1, 0, tokens=TOKENS[:4])
            pid = client.stats().sessions[0].worker_pid
            os.kill(pid, signal.SIGSTOP)  # the holder's next append stays in flight: the only place is busy
            holder = threading.Thread(target=lambda: other.append("holder", 1, 4, tokens=TOKENS[4:8]))
            holder.start()
            while not client.stats().sessions[0].in_flight:
                time.sleep(0.01)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(daemon.socket))
            sock.sendall(encode(Hello(version=PROTOCOL_VERSION)))
            read_frame(sock)
            sock.sendall(encode(Append(session_id="B", epoch=1, start_pos=0, tokens=TOKENS[:6], admit_timeout_s=60.0, request_id=5)))
            time.sleep(1.0)  # the daemon reads it and puts it in the admission line
            print("Release(B, 2) while B@1 waits:", answer(lambda: client.release("B", 2)))
            os.kill(pid, signal.SIGCONT)
            holder.join()
            waiting = read_frame(sock)
            print("the waiting Append(B, 1, 0):", type(waiting).__name__, getattr(waiting, "code", ""), f"length={waiting.length}")
            sock.close()
            print("Append(B, 1, 6):", answer(lambda: client.append("B", 1, 6, tokens=TOKENS[6:7])))
            print("Append(B, 2, 0):", answer(lambda: client.append("B", 2, 0, tokens=TOKENS[:3])))
            print("integrity:", client.stats().integrity)
    finally:
        daemon.stop()


def scenario_volume(shard: pathlib.Path, run_dir: pathlib.Path, others: int) -> None:
    print(f"== scenario 2: X reaches epoch 5, is released, then {others} other ids are released")
    daemon = Daemon(shard, run_dir / "s2.sock", ("--threads", "1", "--n-ctx", "64", "--max-sessions", "1"))
    daemon.wait_ready(timeout_s=600)
    try:
        with daemon.client(direct=False) as client:
            client.append("X", 5, 0, tokens=TOKENS[:3])
            client.release("X", 5)
            print("Append(X, 3, 0) right after:", answer(lambda: client.append("X", 3, 0, tokens=TOKENS[:3])))
            started = time.monotonic()
            for index in range(others):
                client.release(f"other-{index}", 6)
            print(f"{others} releases in {time.monotonic() - started:.1f} s")
            print("Append(X, 3, 0) after them:", answer(lambda: client.append("X", 3, 0, tokens=TOKENS[:3])))
            counters = client.stats().counters
            print("epoch_floor:", counters.get("epoch_floor", "(no such counter)"), "fenced_ids:", counters.get("fenced_ids", "(no such counter)"))
    finally:
        daemon.stop()


def main() -> int:
    model = bundled_model_path()
    root = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-fence-"))
    shards = cached_shards(model, parse_splits("0:10,10:20,20:30", 30), root=root / "shards")
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvf-", dir="/tmp"))
    os.chmod(run_dir, 0o700)
    scenario_admission(shards[0].path, run_dir)
    scenario_volume(shards[0].path, run_dir, int(sys.argv[1]) if len(sys.argv) > 1 else 65536)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

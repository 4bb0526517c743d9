"""Where the time of one direct-channel append goes: a middle-shard decode step through a worker's direct
channel, stage by stage on both sides, next to the same step in-process (ShardContext.append).

Part 1 (end to end): a real `kvpool serve` daemon on the middle shard (the bench's mid options), its
session's decode steps over the direct channel vs an in-process context, in alternating blocks.
Part 2 (breakdown): a worker started here as the supervisor starts one (workers.server.main.worker_main,
unchanged, spawned), with time stamps (time.perf_counter_ns: CLOCK_MONOTONIC, one clock for every process)
around each stage of the worker's direct path, and the client's steps stamped here. 1 llama thread.

    PYTHONPATH=. python scripts/probe_direct_path.py [--part breakdown|end-to-end] [--blocks 10] [--steps 50] [--model GGUF]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import secrets
import socket
import statistics
import tempfile
import time

import numpy as np

from kvpool.client.client import AppendResult, Client, append_request
from kvpool.launcher import Daemon
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
from kvpool.wire.framing import FRAME_HEADER, receive_exactly
from kvpool.wire.protocol import decode_reply, encode
from workers.runtime.model import ShardModel
from workers.server.commands import BindChannel, Exit, OpenContext, TruncateContext
from workers.server.segment import CONTROL_BYTES

N_CTX = 1024
HISTORY = 64
SESSION, EPOCH = "probe", 1


def median_us(values: list[int | float], scale: float = 1e-3) -> float:
    return statistics.median(values) * scale if values else float("nan")


# ---- the worker, stamped ---------------------------------------------------------------------------


def stamped_worker(connection, spec, cancel_connection, stamps_path: str) -> None:
    """workers.server.main.worker_main with stamps around the direct path's stages; they are written to
    stamps_path when the worker exits."""
    import workers.runtime.context as context_module
    import workers.server.compute_semaphore as compute_semaphore
    import workers.server.direct as direct
    import workers.server.main as process

    stamps: list[tuple[str, int]] = []
    now = time.perf_counter_ns

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            stamps.append((label + "<", now()))
            try:
                return original(*args, **kwargs)
            finally:
                stamps.append((label + ">", now()))

        setattr(owner, name, wrapped)

    wrap(direct, "read_append", "read")
    wrap(direct.Peer, "write", "send")  # the reply's encoding into the peer's buffer, then what the socket takes of it
    wrap(direct, "encode_into", "encode")
    wrap(direct, "append_rows", "checks")
    wrap(direct.DirectChannel, "_append", "append")
    wrap(direct.DirectCancels, "begin", "cancel_begin")
    wrap(direct.DirectCancels, "end", "cancel_end")
    wrap(compute_semaphore.ComputeSemaphore, "__enter__", "take")
    wrap(compute_semaphore.ComputeSemaphore, "__exit__", "give")
    wrap(context_module.ShardContext, "append_checked", "compute")  # what the direct path calls (workers.server.direct)
    wrap(context_module.llama_cpp, "llama_decode", "decode")
    try:
        process.worker_main(connection, spec, cancel_connection)
    finally:
        pathlib.Path(stamps_path).write_text(json.dumps(stamps))


class StampedWorker:
    """The supervisor's part, just enough: segment, pipes, spawn, open a context, bind the channel."""

    def __init__(self, shard_path: pathlib.Path, semaphore_id: int, stamps_path: str) -> None:
        from multiprocessing import shared_memory

        from workers.server.segment import SegmentRegions
        from workers.server.spec import WorkerSpec

        self.segment = shared_memory.SharedMemory(create=True, size=CONTROL_BYTES + N_CTX * 576 * 4 * 2)
        context = multiprocessing.get_context("spawn")
        self.pipe, child = context.Pipe(duplex=True)
        self.cancel_pipe, child_cancel = context.Pipe(duplex=True)
        self.address = f"kvpool-probe-{os.getpid()}-{secrets.token_hex(4)}"
        spec = WorkerSpec(
            shard_path=str(shard_path), shm_name=self.segment.name, segment=SegmentRegions(input_bytes=N_CTX * 576 * 4, output_bytes=N_CTX * 576 * 4),
            n_threads=1, flash_attn=False, parent_pid=os.getpid(), direct_address=self.address, max_n_ctx=N_CTX,
            compute_semaphore=semaphore_id, worker_index=1,
        )
        self.stamps_path = stamps_path
        self.process = context.Process(target=stamped_worker, args=(child, spec, child_cancel, stamps_path), daemon=True)
        self.process.start()
        child.close()
        child_cancel.close()
        import msgspec

        from workers.server.commands import AnyWorkerReply

        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(AnyWorkerReply)
        self._decoder.decode(self.pipe.recv_bytes())  # Ready
        self.call(OpenContext(n_ctx=N_CTX))
        self.call(BindChannel(session_id=SESSION, epoch=EPOCH))

    def call(self, command):
        self.pipe.send_bytes(self._encoder.encode(command))
        return self._decoder.decode(self.pipe.recv_bytes())

    def close(self) -> None:
        self.pipe.send_bytes(self._encoder.encode(Exit()))
        self.process.join(10)
        self.segment.close()
        self.segment.unlink()


def stamped_client_append(sock: socket.socket, start: int, row: np.ndarray, request_id: int, stamps: dict[str, list[int]]) -> np.ndarray:
    """Client.append's direct path (kvpool.client.channels + kvpool.connection), each step stamped."""
    now = time.perf_counter_ns
    t0 = now()
    request = append_request(SESSION, EPOCH, start, hidden=row, direct=True)
    request.request_id = request_id
    t1 = now()
    frame = encode(request)
    t2 = now()
    sock.sendall(frame)
    t3 = now()
    (size,) = FRAME_HEADER.unpack(receive_exactly(sock, FRAME_HEADER.size))
    t4 = now()
    payload = receive_exactly(sock, size)
    t5 = now()
    reply = decode_reply(payload)
    t6 = now()
    rows = AppendResult.of(reply).rows
    t7 = now()
    for name, value in (("c_request", t1 - t0), ("c_encode", t2 - t1), ("c_sendall", t3 - t2), ("c_wait_header", t4 - t3),
                        ("c_recv_payload", t5 - t4), ("c_decode", t6 - t5), ("c_result", t7 - t6), ("c_total", t7 - t0)):
        stamps.setdefault(name, []).append(value)
    stamps.setdefault("c_sent_at", []).append(t2)
    stamps.setdefault("c_header_at", []).append(t4)
    return rows


def _worker_spans(worker_stamps: list, client_stamps: dict[str, list[int]]) -> dict[str, list[int]]:
    """Per append (the history prefills, stamped on the worker but not on the client, are left out)."""
    appends: list[dict[str, int]] = []
    current: dict[str, int] = {}
    for label, value in worker_stamps:
        if label == "read<":
            current = {}
        current.setdefault(label, value)
        if label == "send>" and "compute<" in current:
            appends.append(current)
    appends = [a for a in appends if a["read<"] >= client_stamps["c_first_sent_at"][0]]  # not the history's
    assert len(appends) == len(client_stamps["c_sent_at"]), (len(appends), len(client_stamps["c_sent_at"]))
    pairs = list(zip(appends, client_stamps["c_sent_at"], client_stamps["c_header_at"]))
    return {
        "w_wake (client sent -> worker reads)": [a["read<"] - sent for a, sent, _h in pairs],
        "w_read (frame recv + decode)": [a["read>"] - a["read<"] for a, _s, _h in pairs],
        "w_checks (append_rows)": [a["checks>"] - a["checks<"] for a, _s, _h in pairs],
        "w_cancels (begin + end)": [a["cancel_begin>"] - a["cancel_begin<"] + a["cancel_end>"] - a["cancel_end<"] for a, _s, _h in pairs],
        "w_semaphore (compute unit: take + give back)": [a["take>"] - a["take<"] + a["give>"] - a["give<"] for a, _s, _h in pairs],
        "w_compute (ShardContext.append_checked)": [a["compute>"] - a["compute<"] for a, _s, _h in pairs],
        "w_compute: llama_decode": [a["decode>"] - a["decode<"] for a, _s, _h in pairs],
        "w_rest of _append (flags, reply struct)": [a["append>"] - a["append<"] - (a["checks>"] - a["checks<"]) - (a["compute>"] - a["compute<"])
                                                     - (a["cancel_begin>"] - a["cancel_begin<"] + a["cancel_end>"] - a["cancel_end<"])
                                                     - (a["take>"] - a["take<"] + a["give>"] - a["give<"]) for a, _s, _h in pairs],
        "w_send: encode": [a["encode>"] - a["encode<"] for a, _s, _h in pairs],
        "w_send: sendall": [a["send>"] - a["encode>"] for a, _s, _h in pairs],
        "w_send< -> client has header": [header - a["send<"] for a, _s, header in pairs],
        "w_wake back (worker sent -> client has header)": [header - a["send>"] for a, _s, header in pairs],
    }


def breakdown(shard_path: pathlib.Path, hidden: np.ndarray, model: ShardModel, steps: int, blocks: int) -> None:
    """A stamped worker's direct channel and the in-process context, in alternating blocks of `steps`
    decode steps."""
    names = ("in-process", "direct")
    client_stamps: dict[str, dict[str, list[int]]] = {name: {} for name in names}
    with tempfile.TemporaryDirectory(prefix="kvpool-probe-") as directory:
        from workers.server import compute_semaphore

        workers, sockets = {}, {}
        local = model.new_context(N_CTX)
        import workers.runtime.context as context_module

        decode, local_decodes = context_module.llama_cpp.llama_decode, []

        def timed_decode(*args):
            started = time.perf_counter_ns()
            try:
                return decode(*args)
            finally:
                local_decodes.append(time.perf_counter_ns() - started)

        semaphore = compute_semaphore.create(os.path.join(directory, "compute"), 1)
        context_module.llama_cpp.llama_decode = timed_decode
        try:
            for name in names[1:]:
                workers[name] = StampedWorker(shard_path, semaphore.id, os.path.join(directory, f"{len(workers)}.json"))
                sockets[name] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sockets[name].settimeout(300.0)  # Client's default
                sockets[name].connect("\0" + workers[name].address)
                stamped_client_append(sockets[name], 0, hidden[:HISTORY], 1, {})
            local.append(0, hidden=hidden[:HISTORY])
            request_id = 2
            for block in range(blocks):
                for name in names if block % 2 == 0 else names[::-1]:
                    stamps = client_stamps[name]
                    stamps.setdefault("c_first_sent_at", []).append(time.perf_counter_ns())
                    for step in range(steps):
                        position = HISTORY + step
                        row = hidden[position : position + 1]
                        if name == "in-process":
                            started = time.perf_counter_ns()
                            local.append(position, hidden=row)
                            stamps.setdefault("c_total", []).append(time.perf_counter_ns() - started)
                        else:
                            stamped_client_append(sockets[name], position, row, request_id, stamps)
                            request_id += 1
                    if name == "in-process":
                        local.truncate(HISTORY)
                    else:
                        workers[name].call(TruncateContext(length=HISTORY))
                        workers[name].call(BindChannel(session_id=SESSION, epoch=EPOCH))
        finally:
            for each in sockets.values():
                each.close()
            context_module.llama_cpp.llama_decode = decode
            local.close()
            for worker in workers.values():
                worker.close()
            compute_semaphore.destroy(semaphore)
        spans = {name: _worker_spans(json.loads(pathlib.Path(worker.stamps_path).read_text()), client_stamps[name]) for name, worker in workers.items()}
    print(f"breakdown: {blocks} blocks x {steps} decode steps after {HISTORY} rows, interleaved; medians in us")
    print(f"  {'':48s} " + " ".join(f"{name:>16s}" for name in names[1:]))
    rows = ["c_request", "c_encode", "c_sendall", *next(iter(spans.values())), "c_recv_payload", "c_decode", "c_result", "c_total"]
    for row in rows:
        values = [median_us(client_stamps[name][row] if row.startswith("c_") else spans[name][row]) for name in names[1:]]
        print(f"  {row:48s} " + " ".join(f"{value:16.1f}" for value in values))
    local_us = median_us(client_stamps["in-process"]["c_total"])
    print(f"  {'in-process ShardContext.append':48s} {local_us:16.1f}")
    print(f"  {'in-process llama_decode':48s} {median_us(local_decodes):16.1f}")
    for name in names[1:]:
        total = median_us(client_stamps[name]["c_total"])
        print(f"  {name}: overhead {total - local_us:.1f} us, ratio {local_us / total:.3f}")


# ---- end to end, through a real daemon --------------------------------------------------------------


def end_to_end(shard_path: pathlib.Path, hidden: np.ndarray, model: ShardModel, steps: int, blocks: int, history: int) -> None:
    """As the bench's section 1 does it: each block empties the session (through the daemon, which revokes
    the channel), prefills `history` rows (through the daemon, which binds it again), then `steps` decode
    steps over the direct channel; the in-process context alike; blocks alternate."""
    with tempfile.TemporaryDirectory(prefix="kvpool-probe-") as directory:
        options = ["--ttl", "600", "--threads-per-worker", "1", "--n-ctx", str(N_CTX), "--threads", "1", "--max-sessions", "1"]
        daemon = Daemon(shard_path, pathlib.Path(directory) / "mid.sock", options)
        try:
            daemon.wait_ready()
            client = Client(daemon.socket, name="probe")
            local = model.new_context(N_CTX)
            times: dict[str, list[list[float]]] = {"daemon": [], "in-process": []}

            def run(name: str) -> None:
                if name == "daemon":
                    if admitted:
                        client.truncate(SESSION, EPOCH, 0)
                    client.append(SESSION, EPOCH, 0, hidden=hidden[:history])
                    append = lambda position, row: client.append(SESSION, EPOCH, position, hidden=row)  # noqa: E731
                else:
                    local.truncate(0)
                    local.append(0, hidden=hidden[:history])
                    append = lambda position, row: local.append(position, hidden=row)  # noqa: E731
                block = []
                for step in range(steps):
                    position = history + step
                    started = time.perf_counter()
                    append(position, hidden[position : position + 1])
                    block.append(time.perf_counter() - started)
                times[name].append(block)

            admitted = False
            run("daemon")  # warm-up; admits
            admitted = True
            run("in-process")
            times = {name: [] for name in times}
            for block in range(blocks):
                for name in (["daemon", "in-process"] if block % 2 == 0 else ["in-process", "daemon"]):
                    run(name)
            direct = client.stats().counters["direct_appends"]
            flat = {name: [value for block in blocks_ for value in block] for name, blocks_ in times.items()}
            daemon_ms, local_ms = median_us(flat["daemon"], 1e3), median_us(flat["in-process"], 1e3)
            print(f"end to end, {blocks} blocks x {steps} decode steps after {history} rows: daemon (direct channel) {daemon_ms:.3f} ms, "
                  f"in-process {local_ms:.3f} ms, ratio {local_ms / daemon_ms:.3f}, overhead {daemon_ms - local_ms:.3f} ms "
                  f"(the daemon counted {direct} direct appends)")
            first = [median_us([block[0] for block in times[name]], 1e3) for name in ("daemon", "in-process")]
            print(f"  first step of a block: daemon {first[0]:.3f} ms, in-process {first[1]:.3f} ms")
            client.release(SESSION, EPOCH)
            client.close()
            local.close()
        finally:
            daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="breakdown: decode steps per block")
    parser.add_argument("--blocks", type=int, default=10, help="alternating blocks of each variant")
    parser.add_argument("--block-steps", type=int, default=8, help="end to end: decode steps per block (the quick bench's 8)")
    parser.add_argument("--history", type=int, default=16, help="end to end: rows prefilled before each block (the quick bench's 16)")
    parser.add_argument("--part", choices=("both", "breakdown", "end-to-end"), default="both")
    parser.add_argument("--model", type=pathlib.Path, default=None, help="the GGUF to cut in three (default: the bundled model)")
    args = parser.parse_args()
    source = args.model or bundled_model_path()
    shards = shards_in_parts(source, 3)
    with ShardModel(shards[0].path, n_threads=1) as first, first.new_context(N_CTX) as context:
        filler = np.random.default_rng(0).integers(0, first.shape.n_vocab, max(HISTORY + args.steps, args.history + args.block_steps) + 8).astype(np.int32)
        hidden = context.append(0, tokens=filler).copy()
    with ShardModel(shards[1].path, n_threads=1) as model:
        if args.part in ("both", "breakdown"):
            breakdown(shards[1].path, hidden, model, args.steps, args.blocks)
        if args.part in ("both", "end-to-end"):
            end_to_end(shards[1].path, hidden, model, args.block_steps, args.blocks, args.history)


if __name__ == "__main__":
    main()

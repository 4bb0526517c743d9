"""The floor of a route of processes on this machine: the same shards served by processes with no kvpool code in
them - one process a shard, a llama context of the bench's threads, the workers' idle spin (workers.server.spin),
a 13-byte header and the rows' bytes on a Unix socketpair; no msgspec, no supervisor, no checks, no selector. The
bench relays a step through them as kvpool's router relays it through the daemons (the client carries each hop's
rows), in turns with the daemons and the in-process references, so a ratio of kvpool against it is kvpool's own
cost and the relay against the in-process reference is what any route of processes pays here: each process's
threads sleep while the others compute, and on a small VM a step whose threads slept is slower
(evidence/daemon-overhead/README.md, "Stop 53").

`python -m kvpool.bench.relay SHARD THREADS N_CTX FD` is one of its processes (started by Relay)."""

from __future__ import annotations

import contextlib
import pathlib
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

HEADER = struct.Struct("<BIII")  # what, start position, rows, payload bytes
APPEND, RESET, TOKEN = 0, 1, 2  # TOKEN: the reply of the last shard, the token it picked
READY = b"R"
STOP_HANG_GUARD_S = 60.0  # a relay process's exit after its socket closed; killed past it


def _receive(sock: socket.socket, size: int) -> bytearray | None:
    """`size` bytes, or None where the other end closed before the first."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            if got == 0:
                return None
            raise EOFError(f"the relay's socket closed {got} bytes into {size}")
        got += count
    return buffer


def _send(sock: socket.socket, what: int, start: int, rows: int, payload: bytes | memoryview) -> None:
    data = memoryview(payload).cast("B")  # an array's buffer counts its bytes, not its rows
    sock.sendall(HEADER.pack(what, start, rows, data.nbytes) + data)


def _reply(sock: socket.socket) -> tuple[int, int, bytearray]:
    header = _receive(sock, HEADER.size)
    if header is None:
        raise EOFError("a relay process closed its socket")
    what, _start, rows, size = HEADER.unpack(header)
    payload = _receive(sock, size) if size else bytearray()
    if payload is None:
        raise EOFError("a relay process closed its socket mid-reply")
    return what, rows, payload


def serve(shard: pathlib.Path, threads: int, n_ctx: int, sock: socket.socket) -> None:
    """One relay process: appends and resets on its one context until the bench closes the socket. The last shard
    answers the token it picks (argmax of the last row), as a route sampling on its last daemon does."""
    from workers.server.spin import DEFAULT_IDLE_SPIN, set_idle_spin

    set_idle_spin(DEFAULT_IDLE_SPIN)  # before llama.cpp loads, as a worker does
    from workers.runtime.model import ShardModel

    with ShardModel(shard, n_threads=threads) as model, model.new_context(n_ctx) as context:
        shape = model.shape
        sock.sendall(READY)
        while (header := _receive(sock, HEADER.size)) is not None:
            what, start, rows, size = HEADER.unpack(header)
            data = _receive(sock, size) if size else bytearray()
            if what == RESET:
                context.truncate(0)
                _send(sock, RESET, 0, 0, b"")
                continue
            if shape.is_first:
                out = context.append(start, tokens=np.frombuffer(data, np.int32))
            else:
                out = context.append(start, hidden=np.frombuffer(data, np.float32).reshape(rows, shape.n_embd))
            if shape.is_last:
                _send(sock, TOKEN, start, 1, np.int32(np.argmax(out[-1])).tobytes())
            else:
                _send(sock, APPEND, start, out.shape[0], out.data)


class Relay:
    """The relay's processes, one a shard in route order, started at once; close() ends them."""

    def __init__(self, shards: Sequence[pathlib.Path], *, threads: int, n_ctx: int) -> None:
        self._sockets: list[socket.socket] = []
        self._processes: list[subprocess.Popen] = []
        try:
            for shard in shards:
                ours, theirs = socket.socketpair()
                self._sockets.append(ours)
                with theirs:
                    command = [sys.executable, "-m", "kvpool.bench.relay", str(shard), str(threads), str(n_ctx), str(theirs.fileno())]
                    self._processes.append(subprocess.Popen(command, pass_fds=[theirs.fileno()]))
            for sock, process in zip(self._sockets, self._processes):
                if sock.recv(1) != READY:
                    raise RuntimeError(f"a relay process did not start (exit code {process.wait()})")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def reset(self) -> None:
        for sock in self._sockets:
            _send(sock, RESET, 0, 0, b"")
            _reply(sock)

    def append(self, start: int, rows: np.ndarray) -> np.ndarray:
        """`rows` (token ids for a route starting at the first shard, else hidden states) through every process in
        turn, the client carrying each hop's rows: the last process's rows (hidden states), or the token it picked
        as a one-element int32 array where it holds the model's last layers."""
        data = np.ascontiguousarray(rows)
        count = data.shape[0]
        for sock in self._sockets:
            _send(sock, APPEND, start, count, data.data)
            what, count, payload = _reply(sock)
            data = np.frombuffer(payload, np.int32) if what == TOKEN else np.frombuffer(payload, np.float32).reshape(count, -1)
        return data

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        for process in self._processes:
            try:
                process.wait(STOP_HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._sockets, self._processes = [], []


def main(argv: Sequence[str]) -> None:
    shard, threads, n_ctx, fd = argv
    with socket.socket(fileno=int(fd)) as sock, contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(pathlib.Path(shard), int(threads), int(n_ctx), sock)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The floor of a route of processes on this machine: the same shards served by processes with no kvpool code in
them - one process a shard, a llama context of the bench's threads, the workers' idle spin (workers.server.spin),
a 13-byte header and the rows' bytes on a Unix socketpair (read with kvpool.wire.framing.receive_exactly, a plain
loop of recv_into); no msgspec, no supervisor, no checks, no selector. The
bench relays a step through them as kvpool's router relays it through the daemons (the client carries each hop's
rows), in turns with the daemons and the in-process references, so a ratio of kvpool against it is kvpool's own
cost and the relay against the in-process reference is what any route of processes pays here: each process's
threads sleep while the others compute, and on a small VM a step whose threads slept is slower
(evidence/daemon-overhead/README.md, "Stop 53").

What a worker does and the relay does not: no keep-warm spinners of its own (the daemons' spin at idle priority for
--keep-warm after their own requests, whichever variant runs then), glibc's allocator as it comes (a worker fixes its
mmap threshold and keeps one output array; glibc's own threshold rises after the first free, so a decode step's
output stays on the heap here too), a fresh output array a step.

`python -m kvpool.bench.relay SHARD THREADS N_CTX FD` is one of its processes (started by Relay)."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from kvpool.wire.framing import receive_exactly

HEADER = struct.Struct("<BIII")  # what, start position, rows, payload bytes
APPEND, RESET, TOKEN = 0, 1, 2  # TOKEN: the reply of the last shard, the token it picked
READY = b"R"
STOP_HANG_GUARD_S = 60.0  # a relay process's exit after its socket closed; killed past it
HANG_GUARD_S = 600.0  # a relay process's load or step: far beyond any machine's; past it the bench stops with an error


class RelayFailed(RuntimeError):
    """A relay process ended, answered out of turn, or gave no answer within HANG_GUARD_S."""


def _send(sock: socket.socket, what: int, start: int, rows: int, payload: bytes | memoryview) -> None:
    data = memoryview(payload).cast("B")  # an array's buffer counts its bytes, not its rows
    sock.sendall(HEADER.pack(what, start, rows, data.nbytes) + data)


def _read(sock: socket.socket) -> tuple[int, int, int, bytes] | None:
    """The next message (what, start position, rows, payload), or None where the other end closed the socket."""
    header = receive_exactly(sock, HEADER.size)
    if header is None:
        return None
    what, start, rows, size = HEADER.unpack(header)
    payload = receive_exactly(sock, size) if size else b""
    return None if payload is None else (what, start, rows, payload)


def serve(shard: pathlib.Path, threads: int, n_ctx: int, sock: socket.socket) -> None:
    """One relay process: appends and resets on its one context until the bench closes the socket. The last shard
    answers the token it picks (argmax of the last row), as a route sampling on its last daemon does. A payload
    whose size is not its rows' (int32 token ids into a first shard, float32 hidden states elsewhere) ends it."""
    from workers.server.spin import DEFAULT_IDLE_SPIN, set_idle_spin

    set_idle_spin(DEFAULT_IDLE_SPIN)  # before llama.cpp loads, as a worker does
    from workers.runtime.model import ShardModel

    with ShardModel(shard, n_threads=threads) as model, model.new_context(n_ctx) as context:
        shape = model.shape
        sock.sendall(READY)
        while (message := _read(sock)) is not None:
            what, start, rows, data = message
            size = len(data)
            if what == RESET:
                context.truncate(0)
                _send(sock, RESET, 0, 0, b"")
                continue
            width = 1 if shape.is_first else shape.n_embd
            if size != rows * width * 4:
                raise ValueError(f"{rows} rows of {width} take {rows * width * 4} bytes, not {size}")
            if shape.is_first:
                out = context.append(start, tokens=np.frombuffer(data, np.int32))
            else:
                out = context.append(start, hidden=np.frombuffer(data, np.float32).reshape(rows, width))
            if shape.is_last:
                _send(sock, TOKEN, start, 1, np.int32(np.argmax(out[-1])).tobytes())
            else:
                _send(sock, APPEND, start, out.shape[0], out.data)


class Relay:
    """The relay's processes, one a shard in route order, started at once; close() ends them."""

    def __init__(self, shards: Sequence[pathlib.Path], *, threads: int, n_ctx: int) -> None:
        self._sockets: list[socket.socket] = []
        self._processes: list[subprocess.Popen] = []
        self._shards = [pathlib.Path(shard) for shard in shards]
        try:
            for shard in self._shards:
                ours, theirs = socket.socketpair()
                ours.settimeout(HANG_GUARD_S)
                self._sockets.append(ours)
                with theirs:
                    command = [sys.executable, "-m", "kvpool.bench.relay", str(shard), str(threads), str(n_ctx), str(theirs.fileno())]
                    self._processes.append(subprocess.Popen(command, pass_fds=[theirs.fileno()]))
            for index, sock in enumerate(self._sockets):
                with self._guarded(index, "its load"):
                    if sock.recv(1) != READY:
                        raise EOFError("it closed its socket")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _guarded(self, index: int, what: str):
        """Process `index`'s answer read inside: its end, or no answer within HANG_GUARD_S, raised as RelayFailed."""
        try:
            yield
        except (EOFError, OSError) as error:  # socket.timeout is an OSError
            process, code = self._processes[index], None
            timed_out = isinstance(error, TimeoutError)
            if not timed_out:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = process.wait(STOP_HANG_GUARD_S)
            state = f"no answer in {HANG_GUARD_S:g} s (a hang guard)" if timed_out else f"exit code {code}" if code is not None else "still running"
            raise RelayFailed(f"the relay process of {self._shards[index].name} (pid {process.pid}) failed during {what}: {error}; {state}") from error

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def reset(self) -> None:
        for index, sock in enumerate(self._sockets):
            self._ask(index, RESET, 0, np.empty(0, np.int32), (RESET,))

    def append(self, start: int, rows: np.ndarray) -> np.ndarray:
        """`rows` (token ids, sent as int32, for a route starting at the first shard; else hidden states, as float32)
        through every process in turn, the client carrying each hop's rows: the last process's rows (hidden states),
        or the token it picked as a one-element int32 array where it holds the model's last layers."""
        rows = np.asarray(rows)
        data = np.ascontiguousarray(rows, dtype=np.int32 if rows.dtype.kind in "iu" else np.float32)
        for index in range(len(self._sockets)):
            data = self._ask(index, APPEND, start, data, (APPEND, TOKEN))
        return data

    def _ask(self, index: int, what: int, start: int, data: np.ndarray, answers: tuple[int, ...]) -> np.ndarray:
        sock = self._sockets[index]
        with self._guarded(index, "a reset" if what == RESET else f"an append at {start}"):
            _send(sock, what, start, data.shape[0], data.data)
            message = _read(sock)
            if message is None:
                raise EOFError("it closed its socket")
            answered, _start, count, payload = message
            if answered not in answers:
                raise EOFError(f"it answered {answered} where {answers} was due")
        return np.frombuffer(payload, np.int32) if answered in (TOKEN, RESET) else np.frombuffer(payload, np.float32).reshape(count, -1)

    def close(self) -> None:
        """Close every socket (each process then ends), then wait for each, killing one past STOP_HANG_GUARD_S."""
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops its relay (Ctrl-C reaches the whole process group)
    with socket.socket(fileno=int(fd)) as sock, contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(pathlib.Path(shard), int(threads), int(n_ctx), sock)


if __name__ == "__main__":
    main(sys.argv[1:])

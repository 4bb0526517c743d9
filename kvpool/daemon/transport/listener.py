"""The daemon's listening Unix socket: the socket path's safety and the connection limit (the peer check,
applied to each connection by its server, is kvpool.wire.peers').

Connections are accepted one at a time and at most `max_connections` are open at once; one more is
answered over_budget ("too many connections (N)", with retry_after_s) and closed, with one log line per
burst of refusals. The default limit is what RLIMIT_NOFILE leaves after the descriptors the daemon holds,
so accept() never runs out of descriptors (asyncio's own accept loop takes up to its backlog at once and
logs a traceback for every EMFILE).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import resource
import socket
import stat
import time
from collections.abc import Awaitable, Callable

import msgspec

from kvpool.state.shared import SharedState
from kvpool.wire.framing import FRAME_HEADER, FrameTooLarge, frame_size
from kvpool.wire.protocol import ErrorCode, ErrorReply, Hello, decode_request, encode

MAX_CONNECTIONS_CAP = 1024
RESERVED_FDS = 16  # beyond those held at start: worker replacements, spill files, /proc reads, metrics
MAX_REFUSING = 8  # refused connections kept open at once until their Hello is read (each holds an fd)
MAX_REFUSED_HELLO_BYTES = 4096
REFUSAL_RETRY_AFTER_S = 1.0
LOG_GAP_S = 5.0  # log lines about refusals (or failed accepts) are at least this far apart
ACCEPT_RETRY_S = 0.5  # after accept() failed all the same (descriptors taken by something else)
LISTEN_BACKLOG = 128

log = logging.getLogger("kvpool.serve")


class SocketSetupError(Exception):
    pass


def prepare_socket_path(path: pathlib.Path) -> None:
    """Make sure path's directory is ours and private enough, and that no live daemon serves there."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise SocketSetupError(f"the socket directory {directory} is not owned by you (uid {os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SocketSetupError(f"the socket directory {directory} is writable by others: use a private directory")
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketSetupError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a stale socket from a daemon that did not shut down cleanly
        else:
            raise SocketSetupError(f"another daemon is serving on {path}")
        finally:
            probe.close()


def listening_socket(path: pathlib.Path) -> socket.socket:
    """A non-blocking listening socket at path, mode 0600 from its creation."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        previous = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(previous)
        os.chmod(path, 0o600)
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


def derived_max_connections() -> int:
    """What RLIMIT_NOFILE leaves after the descriptors held now, a reserve, the parked states kept in shared
    memory (kvpool.state.shared.SharedState.limit: a descriptor each) and the refusals in progress (one
    connection holds one descriptor), at most MAX_CONNECTIONS_CAP and at least 1."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CAP
    held = len(os.listdir("/proc/self/fd"))
    return max(1, min(MAX_CONNECTIONS_CAP, soft - held - RESERVED_FDS - SharedState.limit - MAX_REFUSING - 1))


class BurstLog:
    """One log line per burst of events, never a traceback: a burst lasts until end() (its cause went
    away: a connection closed, an accept succeeded), and lines are at least gap_s apart."""

    def __init__(self, gap_s: float = LOG_GAP_S) -> None:
        self.gap_s = gap_s
        self._in_burst = False
        self._logged_at = -float("inf")

    def event(self, message: str) -> None:
        now = time.monotonic()
        if not self._in_burst and now - self._logged_at >= self.gap_s:
            log.warning("%s", message)
            self._logged_at = now
            self._in_burst = True

    def end(self) -> None:
        self._in_burst = False


async def _hello_request_id(sock: socket.socket) -> int:
    """The request id of the Hello a connection sends first (0 for anything else), reading at most
    MAX_REFUSED_HELLO_BYTES."""
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < MAX_REFUSED_HELLO_BYTES:
        chunk = await loop.sock_recv(sock, MAX_REFUSED_HELLO_BYTES - len(data))
        if not chunk:
            return 0
        data += chunk
        if len(data) >= FRAME_HEADER.size:
            try:
                size = frame_size(data, MAX_REFUSED_HELLO_BYTES - FRAME_HEADER.size)
            except FrameTooLarge:
                return 0  # not a Hello: it would not fit
            if len(data) >= FRAME_HEADER.size + size:
                try:
                    hello = decode_request(data[FRAME_HEADER.size : FRAME_HEADER.size + size])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    return 0
                return hello.request_id if isinstance(hello, Hello) else 0
    return 0


class Listener:
    """Accepts connections on `path` and runs serve(sock) for each, at most max_connections at once (None:
    derived_max_connections() at start). serve owns the socket it is given."""

    def __init__(
        self, path: pathlib.Path, serve: Callable[[socket.socket], Awaitable[None]], *, max_connections: int | None, hello_timeout_s: float,
    ) -> None:
        self.path = path
        self._serve = serve
        self._configured_max = max_connections
        self.max_connections = max_connections or 0
        self._hello_timeout_s = hello_timeout_s
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self._refusing: set[asyncio.Task] = set()
        self._refusals = BurstLog()
        self._accept_failures = BurstLog()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        self._sock = listening_socket(self.path)
        self.max_connections = self._configured_max or derived_max_connections()
        self._accepting = asyncio.create_task(self._accept_forever(self._sock))

    async def _accept_forever(self, listener: socket.socket) -> None:
        """One connection at a time, so the descriptors in use stay below the limit plus the refusals in
        progress; accept() failing all the same costs a pause and one log line, not the loop."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _address = await loop.sock_accept(listener)
            except OSError as error:
                self._accept_failures.event(f"kvpool serve: cannot accept connections: {error.strerror or error}; retrying")
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            self._accept_failures.end()
            if len(self._connections) >= self.max_connections:
                self._start(self._refusing, self._refuse(sock))
            else:
                self._start(self._connections, self._serve(sock)).add_done_callback(lambda _task: self._refusals.end())

    @staticmethod
    def _start(tasks: set[asyncio.Task], coroutine: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        tasks.add(task)  # counted from accept on, before the task first runs
        task.add_done_callback(tasks.discard)
        return task

    async def _refuse(self, sock: socket.socket) -> None:
        """over_budget in reply to the peer's Hello, read within the Hello deadline (so the reply names its
        request id, and the peer's send does not fail on a closed socket); at once, as request 0, while
        MAX_REFUSING refusals already wait for theirs."""
        message = f"too many connections ({self.max_connections})"
        self._refusals.event(f"kvpool serve: {message}: new connections are refused with over_budget until one closes (logged once per burst)")
        try:
            request_id = 0
            if len(self._refusing) <= MAX_REFUSING:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._hello_timeout_s):
                        request_id = await _hello_request_id(sock)
            sock.send(encode(ErrorReply(code=ErrorCode.OVER_BUDGET, message=message, retry_after_s=REFUSAL_RETRY_AFTER_S, request_id=request_id)))
        except OSError:
            pass
        finally:
            sock.close()

    async def close(self) -> None:
        """Stop accepting and end every connection's task."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        tasks = list(self._connections) + list(self._refusing)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

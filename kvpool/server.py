"""The Unix-socket transport of a daemon: socket safety, peer check, framing, one reply per request,
the requests of one connection handled concurrently."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import socket
import stat
import struct
from collections.abc import Awaitable, Callable

import msgspec

from kvpool.protocol import (
    FRAME_HEADER,
    ReplyMessage,
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloReply,
    Message,
    Request,
    decode_request,
    encode,
)

PEER_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid

Dispatch = Callable[[Request], Awaitable[ReplyMessage]]
Send = Callable[[Message], Awaitable[None]]
# Requests of one connection computed ahead of their replies being read. Each holds its reply in memory
# until written (a few MiB for rows of logits), so a client that stops reading pins at most this many.
MAX_IN_FLIGHT_PER_CONNECTION = 4


def _replies_to(writer: asyncio.StreamWriter) -> Send:
    """Whole frames, one at a time: the lock keeps frames from interleaving and, with drain(), keeps at
    most one frame beyond the transport's high-water mark buffered."""
    lock = asyncio.Lock()

    async def send(message: Message) -> None:
        frame = encode(message)
        async with lock:
            writer.write(frame)
            await writer.drain()

    return send


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


class FrameServer:
    """Accepts connections, checks the peer and the protocol version, and answers each request of a
    connection as it completes (replies echo the request_id; their order is the order of completion)."""

    def __init__(
        self, path: pathlib.Path, hello: HelloReply, dispatch: Dispatch, *, max_request_bytes: int,
        max_in_flight: int = MAX_IN_FLIGHT_PER_CONNECTION,
    ) -> None:
        self.path = path
        self.hello = hello
        self.dispatch = dispatch
        self.max_request_bytes = max_request_bytes
        self.max_in_flight = max_in_flight
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        prepare_socket_path(self.path)
        previous = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._on_connection, path=str(self.path))
        finally:
            os.umask(previous)
        os.chmod(self.path, 0o600)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if self._peer_allowed(writer):
                await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the daemon is closing this connection
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    def _peer_allowed(writer: asyncio.StreamWriter) -> bool:
        sock = writer.get_extra_info("socket")
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
        _pid, uid, _gid = PEER_CREDENTIALS.unpack(credentials)
        return uid == os.getuid()

    async def _read_frame(self, reader: asyncio.StreamReader, send: Send) -> bytes | None:
        header = await reader.readexactly(FRAME_HEADER.size)
        (size,) = FRAME_HEADER.unpack(header)
        if size > self.max_request_bytes:
            await send(ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"frame of {size} bytes exceeds the limit of {self.max_request_bytes}"))
            return None
        return await reader.readexactly(size)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        send = _replies_to(writer)
        payload = await self._read_frame(reader, send)
        if payload is None:
            return
        try:
            hello = decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            await send(ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"expected Hello: {error}"))
            return
        if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
            await send(ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"the first frame must be Hello with version {PROTOCOL_VERSION}"))
            return
        await send(msgspec.structs.replace(self.hello, request_id=hello.request_id))
        await self._serve_requests(reader, send)

    async def _serve_requests(self, reader: asyncio.StreamReader, send: Send) -> None:
        """Each request is answered by its own task, as soon as it completes. At most max_in_flight are
        read ahead of their replies: a slot is freed only once its reply is written (and drained), so a
        client that stops reading stops this loop reading, and the connection's memory stays bounded."""
        slots = asyncio.Semaphore(self.max_in_flight)
        answering: set[asyncio.Task] = set()
        try:
            while True:
                await slots.acquire()
                try:
                    payload = await self._read_frame(reader, send)
                except BaseException:
                    slots.release()
                    raise
                if payload is None:
                    return
                task = asyncio.create_task(self._answer(payload, send, slots))
                answering.add(task)
                task.add_done_callback(answering.discard)
        except asyncio.CancelledError:
            for task in answering:
                task.cancel()  # the daemon is closing: requests in flight go with their connection
            raise
        finally:
            # End of file or a refused frame: the requests already read are still handled and answered.
            if answering:
                await asyncio.gather(*answering, return_exceptions=True)

    async def _answer(self, payload: bytes, send: Send, slots: asyncio.Semaphore) -> None:
        try:
            try:
                request = decode_request(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                reply: Message = ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"malformed request: {error}")
            else:
                reply = await self.dispatch(request)
                reply.request_id = request.request_id
            with contextlib.suppress(ConnectionError):  # the client went away: nobody to answer
                await send(reply)
        finally:
            slots.release()

    async def close(self) -> None:
        """Stop accepting, end open connections, remove the socket file."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

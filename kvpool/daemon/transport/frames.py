"""The Unix-socket transport of a daemon: framing, the handshake, one reply per request, the requests of
one connection handled concurrently, and what any one client may hold of the daemon (the listening socket
and the connection limit are kvpool.daemon.transport.listener's; the framing rule and the peer check, the
wire's: kvpool.wire.framing, kvpool.wire.peers).

Limits (ConnectionLimits): at most `max_connections` connections (one more is answered over_budget and
closed); a Hello that arrives whole within `handshake_timeout_s`; every later frame whole within
`frame_timeout_s` of its first byte (an idle connection between frames stays open); request bytes held
across all connections bounded by `buffered_request_bytes` (kvpool.daemon.transport.allowance); per connection at most
`max_in_flight` requests ahead of their replies, plus one control request (Cancel, Stats) read while that
limit is reached, so a cancel never queues behind the requests it is meant to interrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import socket
from collections.abc import Awaitable, Callable

import msgspec

from kvpool.daemon.transport.allowance import ByteAllowance, HeldBytes
from kvpool.daemon.transport.listener import Listener, prepare_socket_path
from kvpool.wire.framing import FRAME_HEADER, FrameTooLarge, frame_size
from kvpool.wire.peers import same_user
from kvpool.wire.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloReply,
    Message,
    ReplyMessage,
    Request,
    Stats,
    decode_request,
    encode,
)

Dispatch = Callable[[Request], Awaitable[ReplyMessage]]
Send = Callable[[Message], Awaitable[None]]
# Requests of one connection computed ahead of their replies being read. Each holds its reply in memory
# until written (a few MiB for rows of logits), so a client that stops reading pins at most this many
# replies: the daemon-wide buffered_request_bytes bounds request bytes only, not replies, so this stays
# small (the --slow-reader drill's RSS bound holds with it).
MAX_IN_FLIGHT_PER_CONNECTION = 4
CONTROL_REQUESTS = (Cancel, Stats)  # answered without waiting on any session: read even at the limit
CLOSE_TIMEOUT_S = 5.0  # a closing connection's unsent replies: dropped after this


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What the clients may hold of the daemon (from ServeConfig; see the module docstring)."""

    handshake_timeout_s: float
    frame_timeout_s: float
    buffered_request_bytes: int
    max_connections: int | None  # None: kvpool.daemon.transport.listener.derived_max_connections() at start
    max_in_flight: int = MAX_IN_FLIGHT_PER_CONNECTION


class FrameTooSlow(Exception):
    """A frame (or the Hello) did not arrive whole in time: the connection is closed."""


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


class InFlight:
    """One connection's requests between being read and being answered: at most `limit`, plus one control
    request read while the limit is reached. The read loop reads a frame only when one of those places is
    free, so beyond them it holds at most the one frame it read (until a place frees)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.requests = 0
        self.control_beyond_limit = False
        self._freed = asyncio.Event()

    def _can_read(self) -> bool:
        return self.requests < self.limit or not self.control_beyond_limit

    async def room_to_read(self) -> None:
        while not self._can_read():
            await self._freed.wait()

    async def take(self, control: bool) -> Callable[[], None]:
        """A place for a request just read, and the call that frees it."""
        while True:
            if self.requests < self.limit:
                self.requests += 1
                return self._free_request
            if control and not self.control_beyond_limit:
                self.control_beyond_limit = True
                return self._free_control
            await self._freed.wait()

    def _free_request(self) -> None:
        self.requests -= 1
        self._notify()

    def _free_control(self) -> None:
        self.control_beyond_limit = False
        self._notify()

    def _notify(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()


class SocketTransport:
    """Accepts connections, checks the peer and the protocol version, and answers each request of a
    connection as it completes (replies echo the request_id; their order is the order of completion)."""

    def __init__(
        self, path: pathlib.Path, hello: HelloReply, dispatch: Dispatch, *, max_request_bytes: int, limits: ConnectionLimits,
    ) -> None:
        self.path = path
        self.hello = hello
        self.dispatch = dispatch
        self.max_request_bytes = max_request_bytes
        self.limits = limits
        self.allowance = ByteAllowance(limits.buffered_request_bytes)
        self.listener = Listener(path, self._on_connection, max_connections=limits.max_connections, hello_timeout_s=limits.handshake_timeout_s)
        self._senders: set[Send] = set()  # the open connections past their handshake (a farewell goes to each)

    async def start(self) -> None:
        prepare_socket_path(self.path)
        await self.listener.start()

    async def _on_connection(self, sock: socket.socket) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            if not same_user(sock):
                return
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader()
            protocol = asyncio.StreamReaderProtocol(reader)
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, OSError):
            pass  # end of file, or the connection broke
        except asyncio.CancelledError:
            pass  # the daemon is closing this connection
        finally:
            if writer is None:
                sock.close()
            else:
                await self._closed(writer)

    @staticmethod
    async def _closed(writer: asyncio.StreamWriter) -> None:
        """Close, flushing what is buffered, unless the peer does not read it within CLOSE_TIMEOUT_S."""
        writer.close()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await writer.wait_closed()
        except TimeoutError:
            writer.transport.abort()
        except Exception:  # noqa: BLE001 - the connection is gone either way
            pass

    # ---- frames -------------------------------------------------------------------------------------

    async def _read_frame(self, reader: asyncio.StreamReader, send: Send) -> tuple[bytes, HeldBytes] | None:
        """The next frame and its room in the allowance (the caller gives it back), or None when it was
        refused. Waiting for the first byte has no deadline; from it on, the frame must arrive within
        frame_timeout_s, not counting the time it waited for room (the daemon held it back, not the peer)."""
        loop = asyncio.get_running_loop()
        first = await reader.readexactly(1)
        deadline = loop.time() + self.limits.frame_timeout_s
        header = first + await self._before(deadline, reader.readexactly(FRAME_HEADER.size - 1))
        try:
            size = frame_size(header, min(self.max_request_bytes, self.allowance.limit))
        except FrameTooLarge as refused:
            await send(ErrorReply(code=ErrorCode.BAD_REQUEST, message=str(refused)))
            return None
        waiting_since = loop.time()
        held = await self.allowance.take(size)
        try:
            deadline += loop.time() - waiting_since
            return await self._before(deadline, reader.readexactly(size)), held
        except BaseException:
            held.give_back()
            raise

    async def _before(self, deadline: float, read: Awaitable[bytes]) -> bytes:
        try:
            async with asyncio.timeout_at(deadline):
                return await read
        except TimeoutError:
            raise FrameTooSlow(f"a frame did not arrive whole within {self.limits.frame_timeout_s:g} s") from None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        send = _replies_to(writer)
        try:
            hello = await self._handshake(reader, send)
            if hello is not None:
                await send(msgspec.structs.replace(self.hello, request_id=hello.request_id))
                self._senders.add(send)
                await self._serve_requests(reader, send)
        except FrameTooSlow as slow:
            await self._notify_closing(send, str(slow))
        finally:
            self._senders.discard(send)

    async def _handshake(self, reader: asyncio.StreamReader, send: Send) -> Hello | None:
        try:
            async with asyncio.timeout(self.limits.handshake_timeout_s):
                frame = await self._read_frame(reader, send)
        except TimeoutError:
            raise FrameTooSlow(f"no Hello within {self.limits.handshake_timeout_s:g} s") from None
        if frame is None:
            return None
        payload, held = frame
        held.give_back()  # a Hello is answered at once
        try:
            hello = decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            await send(ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"expected Hello: {error}"))
            return None
        if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
            await send(ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"the first frame must be Hello with version {PROTOCOL_VERSION}"))
            return None
        return hello

    @staticmethod
    async def _notify(send: Send, message: Message) -> None:
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await send(message)

    @staticmethod
    async def _notify_closing(send: Send, message: str) -> None:
        """Best effort: a peer too slow to send may be too slow to read as well."""
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await send(ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"{message}: closing the connection"))

    async def _serve_requests(self, reader: asyncio.StreamReader, send: Send) -> None:
        """Each request is answered by its own task, as soon as it completes. A place in InFlight is freed
        only once its reply is written (and drained), so a client that stops reading stops this loop
        reading, and the connection's memory stays bounded."""
        in_flight = InFlight(self.limits.max_in_flight)
        answering: set[asyncio.Task] = set()
        try:
            while True:
                await in_flight.room_to_read()
                frame = await self._read_frame(reader, send)
                if frame is None:
                    return
                request, held = self._decoded(frame[0]), frame[1]
                del frame  # the decoded request holds its own copy of the bytes it needs
                try:
                    free = await in_flight.take(control=isinstance(request, CONTROL_REQUESTS))
                except BaseException:
                    held.give_back()
                    raise
                task = asyncio.create_task(self._answer(request, held, send, free))
                answering.add(task)
                task.add_done_callback(answering.discard)
        except asyncio.CancelledError:
            for task in answering:
                task.cancel()  # the daemon is closing: requests in flight go with their connection
            raise
        finally:
            # End of file, a refused or too slow frame: the requests already read are still answered.
            if answering:
                await asyncio.gather(*answering, return_exceptions=True)

    @staticmethod
    def _decoded(payload: bytes) -> Request | ErrorReply:
        try:
            return decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"malformed request: {error}")

    async def _answer(self, request: Request | ErrorReply, held: HeldBytes, send: Send, free: Callable[[], None]) -> None:
        try:
            try:
                if isinstance(request, ErrorReply):
                    reply: Message = request
                else:
                    reply = await self.dispatch(request)
                    reply.request_id = request.request_id
            finally:
                del request
                held.give_back()  # dispatched: the request's bytes are no longer needed
            with contextlib.suppress(ConnectionError):  # the client went away: nobody to answer
                await send(reply)
        finally:
            free()

    async def close(self, farewell: Message | None = None) -> None:
        """Stop accepting, end open connections (each sent `farewell` first, as request 0, when given and
        the peer reads it within CLOSE_TIMEOUT_S), remove the socket file."""
        if farewell is not None:
            await asyncio.gather(*(self._notify(send, farewell) for send in list(self._senders)))
        await self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

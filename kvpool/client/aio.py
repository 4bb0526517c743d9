"""`kvpool.AsyncClient`: the asyncio client of one shard daemon, with the methods of kvpool.Client.

Many requests are in flight on one connection at once; each carries a fresh request id and its reply is
matched by that id, so replies may come in any order (the daemon answers each request as it completes).
`cancel()` travels on a side connection of its own (opened on first use, like kvpool.Client's), so it never
queues behind the requests it is meant to interrupt.

Any failure of the connection (end of file, an undecodable reply, a reply to an id no request waits for)
fails every request in flight with ConnectionLost and closes it; the next call opens a new connection.
A request that times out (`timeout_s`, for the whole request) or whose task is cancelled is forgotten: its
reply is dropped when it comes, and the other requests on the connection go on. Like a timed-out
synchronous append, it may still have taken effect on the daemon.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Unpack

import msgspec

from kvpool.client.messages import AppendOptions, AppendResult, ConnectionLost, KvpoolError, append_request, checked_reply
from kvpool.wire.protocol import FRAME_HEADER, MAX_REPLY_BYTES, PROTOCOL_VERSION, AppendReply, Cancel, Done, ErrorReply, Hello
from kvpool.wire.protocol import Fork, HelloReply, Park, Release, Reply, RequestMessage, ShardDescription, Shutdown, Stats, StatsReply, Truncate
from kvpool.wire.protocol import decode_reply, encode


class _Connection:
    """One connection after the Hello handshake; its reader task hands each reply to its request."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._forgotten: set[int] = set()  # sent, then timed out or cancelled: their replies are dropped
        self._write_lock = asyncio.Lock()
        self._reading: asyncio.Task | None = None
        self.failure: ConnectionLost | None = None
        self.hello: HelloReply | None = None

    @classmethod
    async def open(cls, path: str, name: str, timeout_s: float | None) -> _Connection:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError as error:
            raise ConnectionLost(f"cannot connect to {path}: {error.strerror or error}") from error
        connection = cls(reader, writer)
        try:
            async with asyncio.timeout(timeout_s):
                connection.hello = await connection._handshake(name)
        except BaseException:
            connection.fail(ConnectionLost("the Hello handshake failed"))
            raise
        connection._reading = asyncio.create_task(connection._read_replies())
        return connection

    @property
    def closed(self) -> bool:
        return self.failure is not None

    async def _handshake(self, name: str) -> HelloReply:
        request_id = next(self._ids)
        self._writer.write(encode(Hello(version=PROTOCOL_VERSION, client=name, request_id=request_id)))
        await self._writer.drain()
        reply = await self._read_reply()
        if isinstance(reply, ErrorReply):
            raise KvpoolError(reply)
        if not isinstance(reply, HelloReply) or reply.request_id != request_id:
            raise ConnectionLost(f"the daemon answered Hello with {type(reply).__name__} {reply.request_id}")
        return reply

    async def _read_reply(self) -> Reply:
        try:
            (size,) = FRAME_HEADER.unpack(await self._reader.readexactly(FRAME_HEADER.size))
            if size > MAX_REPLY_BYTES:
                raise ConnectionLost(f"reply of {size} bytes is larger than any valid reply")
            return decode_reply(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            raise ConnectionLost(f"the daemon closed the connection ({type(error).__name__})") from error
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise ConnectionLost(f"undecodable reply: {error}") from error

    async def _read_replies(self) -> None:
        try:
            while True:
                reply = await self._read_reply()
                future = self._pending.pop(reply.request_id, None)
                if future is not None:
                    if not future.done():
                        future.set_result(reply)
                elif reply.request_id in self._forgotten:
                    self._forgotten.discard(reply.request_id)
                else:
                    raise ConnectionLost(f"the daemon answered request {reply.request_id}, which no request waits for")
        except ConnectionLost as error:
            self.fail(error)
        except OSError as error:
            self.fail(ConnectionLost(f"connection lost: {error}"))

    async def request(self, message: RequestMessage, timeout_s: float | None) -> Reply:
        if self.failure is not None:
            raise ConnectionLost(str(self.failure))
        request_id = next(self._ids)
        message.request_id = request_id
        frame = encode(message)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        sent = False
        try:
            async with asyncio.timeout(timeout_s):
                async with self._write_lock:
                    if self.failure is not None:
                        raise ConnectionLost(str(self.failure))
                    self._writer.write(frame)  # the whole frame is buffered at once: it is sent
                    sent = True
                    try:
                        await self._writer.drain()
                    except ConnectionError as error:
                        self.fail(ConnectionLost(f"connection lost: {error}"))
                return await future
        except BaseException:
            if self._pending.pop(request_id, None) is not None and sent and self.failure is None:
                self._forgotten.add(request_id)
            if future.done() and not future.cancelled():
                future.exception()  # raised here instead: retrieved, so asyncio does not warn about it
            raise

    def fail(self, error: ConnectionLost) -> None:
        """Close the connection for good: every request in flight gets ConnectionLost."""
        if self.failure is not None:
            return
        self.failure = error
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ConnectionLost(str(error)))
        self._writer.close()
        if self._reading is not None and self._reading is not asyncio.current_task():
            self._reading.cancel()

    async def close(self) -> None:
        self.fail(ConnectionLost("this client is closed"))
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
        try:
            await self._writer.wait_closed()
        except (OSError, ConnectionError):
            pass


class AsyncClient:
    """Connects on first use (or `await AsyncClient.connect(path)`, or `async with AsyncClient(path)`)."""

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout_s: float | None = 300.0, name: str = "") -> None:
        self.socket_path = os.fspath(socket_path)
        self.timeout_s = timeout_s  # for one whole request; None: no limit
        self._name = name
        self._connection: _Connection | None = None
        self._cancel_connection: _Connection | None = None  # cancel()'s own lane
        self._connect_lock = asyncio.Lock()
        self._hello: HelloReply | None = None
        self._closed = False

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str], **options) -> AsyncClient:
        client = cls(socket_path, **options)
        await client._connected()
        return client

    @property
    def hello(self) -> HelloReply:
        if self._hello is None:
            raise ConnectionLost("not connected yet")
        return self._hello

    @property
    def shard(self) -> ShardDescription:
        return self.hello.shard

    async def _connected(self, lane: str = "_connection") -> _Connection:
        """The open main (or cancel) connection, (re)opened if a failure closed it."""
        async with self._connect_lock:
            if self._closed:
                raise ConnectionLost("this client is closed")
            connection: _Connection | None = getattr(self, lane)
            if connection is None or connection.closed:
                connection = await _Connection.open(self.socket_path, self._name, self.timeout_s)
                assert connection.hello is not None
                if self._hello is not None and connection.hello.shard != self._hello.shard:
                    await connection.close()
                    raise ConnectionLost(f"the daemon on {self.socket_path} now serves another shard")
                setattr(self, lane, connection)
                self._hello = connection.hello
            return connection

    async def _call(self, message: RequestMessage, expected: type, lane: str = "_connection") -> Reply:
        connection = await self._connected(lane)
        return checked_reply(message, await connection.request(message, self.timeout_s), expected)

    async def append(self, session_id: str, epoch: int, start_pos: int, **options: Unpack[AppendOptions]) -> AppendResult:
        return AppendResult.of(await self._call(append_request(session_id, epoch, start_pos, **options), AppendReply))

    async def truncate(self, session_id: str, epoch: int, length: int) -> int:
        return (await self._call(Truncate(session_id=session_id, epoch=epoch, length=length), Done)).length

    async def release(self, session_id: str, epoch: int) -> Done:
        return await self._call(Release(session_id=session_id, epoch=epoch), Done)

    async def park(self, session_id: str, epoch: int) -> Done:
        """Save the idle session's state to the daemon's spill store and free its context now."""
        return await self._call(Park(session_id=session_id, epoch=epoch), Done)

    async def fork(self, session_id: str, epoch: int, new_session_id: str, new_epoch: int, length: int) -> Done:
        """A new session holding the source's first `length` positions (parked until its first append)."""
        return await self._call(Fork(session_id=session_id, epoch=epoch, new_session_id=new_session_id, new_epoch=new_epoch, length=length), Done)

    async def cancel(self, session_id: str, epoch: int) -> Done:
        """Abort the session's in-flight append; goes on the side connection, never behind that append."""
        return await self._call(Cancel(session_id=session_id, epoch=epoch), Done, "_cancel_connection")

    async def stats(self) -> StatsReply:
        return await self._call(Stats(), StatsReply)

    async def shutdown(self) -> None:
        await self._call(Shutdown(), Done)

    async def close(self) -> None:
        async with self._connect_lock:
            self._closed = True
            connections = (self._connection, self._cancel_connection)
            self._connection = self._cancel_connection = None
        for connection in connections:
            if connection is not None:
                await connection.close()

    async def __aenter__(self) -> AsyncClient:
        await self._connected()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

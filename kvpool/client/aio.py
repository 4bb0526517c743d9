"""`kvpool.AsyncClient`: the asyncio client of one shard daemon, with the methods of kvpool.Client.

Many requests are in flight on one connection at once; each carries a fresh request id and its reply is
matched by that id, so replies may come in any order (the daemon answers each request as it completes).
`cancel()` travels on a side connection of its own (opened on first use, like kvpool.Client's), so it never
queues behind the requests it is meant to interrupt.

Any failure of the connection (end of file, an undecodable reply, a reply to an id no request waits for)
fails every request in flight with ConnectionLost and closes it; the next call opens a new connection.
A request that times out (`timeout_s`, for the whole request) or whose task is cancelled is forgotten: its
reply is dropped when it comes, and the other requests on the connection go on. Like a timed-out
synchronous append, it may still have taken effect on the daemon. After a drain (a `draining` reply, or the
farewell a drained daemon sends each connection) a request no daemon took anything of is sent again to the
daemon that takes over the socket, as kvpool.Client does (kvpool.client.successor); the requests in flight
when the farewell came fail with ConnectionLost.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Unpack

import msgspec

from kvpool.client.messages import (
    AppendOptions,
    AppendResult,
    Call,
    ConnectionLost,
    KvpoolError,
    RequestNotSent,
    Result,
    StateExport,
    admit_prefix_call,
    append_call,
    cancel_call,
    fork_call,
    hello_call,
    import_calls,
    import_chunk_bytes,
    is_farewell,
    park_call,
    prefix_lookup_call,
    release_call,
    restore_call,
    shutdown_call,
    stats_call,
    to_send_again,
    truncate_call,
)
from kvpool.client.successor import DEFAULT_WAIT_S, Say, SuccessorWait
from kvpool.wire.framing import FrameError, read_frame
from kvpool.wire.protocol import MAX_REPLY_BYTES, Done, ErrorReply, HelloReply, Reply, RequestMessage, ShardDescription, StatsReply, decode_reply, encode


def _closed(error: ConnectionError) -> ConnectionLost:
    return ConnectionLost(f"the daemon closed the connection ({type(error).__name__})")


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
            raise RequestNotSent(f"cannot connect to {path}: {error.strerror or error}") from error
        connection = cls(reader, writer)
        try:
            async with asyncio.timeout(timeout_s):
                connection.hello = await connection._handshake(name)
        except ConnectionLost as lost:  # no request of the caller's was sent yet
            connection.fail(ConnectionLost("the Hello handshake failed"))
            raise RequestNotSent(f"the Hello handshake failed: {lost}") from lost
        except BaseException:
            connection.fail(ConnectionLost("the Hello handshake failed"))
            raise
        connection._reading = asyncio.create_task(connection._read_replies())
        return connection

    @property
    def closed(self) -> bool:
        return self.failure is not None

    async def _handshake(self, name: str) -> HelloReply:
        call = hello_call(name)
        call.request.request_id = request_id = next(self._ids)
        try:
            self._writer.write(encode(call.request))
            await self._writer.drain()
        except ConnectionError as error:  # a daemon killed as it accepted: its end reset before the Hello went out
            raise _closed(error) from error
        reply = call.outcome(await self._read_reply())
        if reply.request_id != request_id:
            raise ConnectionLost(f"the daemon answered Hello {request_id} with HelloReply {reply.request_id}")
        return reply

    async def _read_reply(self) -> Reply:
        try:
            payload = await read_frame(self._reader, MAX_REPLY_BYTES)
        except ConnectionError as error:
            raise _closed(error) from error
        except FrameError as error:
            raise ConnectionLost(f"unreadable reply: {error}") from error
        if payload is None:
            raise ConnectionLost("the daemon closed the connection (end of file)")
        try:
            return decode_reply(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise ConnectionLost(f"undecodable reply: {error}") from error

    async def _read_replies(self) -> None:
        try:
            while True:
                reply = await self._read_reply()
                if is_farewell(reply):
                    assert isinstance(reply, ErrorReply)
                    raise RequestNotSent(f"the daemon drained: {reply.message}", drained=True)
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

    def _not_sent(self) -> RequestNotSent:
        """For a request that had not left when the connection failed."""
        return RequestNotSent(str(self.failure), drained=getattr(self.failure, "drained", False))

    async def request(self, message: RequestMessage, timeout_s: float | None) -> Reply:
        if self.failure is not None:
            raise self._not_sent()
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
                        raise self._not_sent()
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

    def __init__(
        self, socket_path: str | os.PathLike[str], *, timeout_s: float | None = 300.0, name: str = "",
        successor_wait_s: float = DEFAULT_WAIT_S, on_successor_wait: Say | None = None,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.timeout_s = timeout_s  # for one whole request; None: no limit
        self.successor_wait_s = successor_wait_s  # after a drain: how long to wait for the daemon that follows
        self.on_successor_wait = on_successor_wait  # told where that wait stands every 15 s (None: silent)
        self._drained = False  # the daemon said it drains: a successor is expected on the socket
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
            if connection is not None and getattr(connection.failure, "drained", False):
                self._drained = True  # its daemon said farewell: wait for the one that follows
            if connection is None or connection.closed:
                connection = await _Connection.open(self.socket_path, self._name, self.timeout_s)
                assert connection.hello is not None
                if self._hello is not None and connection.hello.shard != self._hello.shard:
                    await connection.close()
                    raise ConnectionLost(f"the daemon on {self.socket_path} now serves another shard")
                setattr(self, lane, connection)
                self._hello = connection.hello
            return connection

    async def _call(self, call: Call[Result], lane: str = "_connection") -> Result:
        return call.outcome(await self._request(call.request, lane))

    async def _request(self, message: RequestMessage, lane: str) -> Reply:
        """The reply to `message`; after a drain, sent again (to the daemon that follows) as long as no
        daemon took anything of it, within the successor wait."""
        wait: SuccessorWait | None = None
        while True:
            try:
                connection = await self._connected(lane)
                reply = await connection.request(message, self.timeout_s)
            except RequestNotSent as lost:
                self._drained = self._drained or lost.drained
                if not self._drained or self._closed:
                    raise
                wait = wait or SuccessorWait(self.socket_path, self.successor_wait_s, self.on_successor_wait)
                await asyncio.sleep(wait.pause_s(lost))
                continue
            if not to_send_again(reply):
                self._drained = False  # a daemon serves the socket again
                return reply
            assert isinstance(reply, ErrorReply)
            self._drained = True
            # the connection stays: the requests still on it get their own answers, and its farewell ends it
            wait = wait or SuccessorWait(self.socket_path, self.successor_wait_s, self.on_successor_wait)
            await asyncio.sleep(wait.pause_s(KvpoolError(reply), reply.retry_after_s))

    async def append(self, session_id: str, epoch: int, start_pos: int, **options: Unpack[AppendOptions]) -> AppendResult:
        return await self._call(append_call(session_id, epoch, start_pos, **options))

    async def truncate(self, session_id: str, epoch: int, length: int) -> int:
        return await self._call(truncate_call(session_id, epoch, length))

    async def release(self, session_id: str, epoch: int) -> Done:
        return await self._call(release_call(session_id, epoch))

    async def park(self, session_id: str, epoch: int, *, wait: bool = True) -> Done:
        """Save the idle session's state to the daemon's spill store and free its context now; without
        `wait` answered once the save has begun ("parking"; kvpool.wire.protocol.Park)."""
        return await self._call(park_call(session_id, epoch, wait))

    async def restore(self, session_id: str, epoch: int, *, admit_timeout_s: float = 0.0) -> Done:
        """Make the parked session hot again now ("restored"; "hot": it was not parked), so its next append
        computes at once (kvpool.wire.protocol.Restore; this client has no direct channels)."""
        return await self._call(restore_call(session_id, epoch, admit_timeout_s=admit_timeout_s))

    async def fork(self, session_id: str, epoch: int, new_session_id: str, new_epoch: int, length: int) -> Done:
        """A new session holding the source's first `length` positions (parked until its first append)."""
        return await self._call(fork_call(session_id, epoch, new_session_id, new_epoch, length))

    async def lookup_prefix(self, scope: str, digests: list[bytes]) -> int:
        """How many leading blocks of `digests` (kvpool.wire.prefix) the daemon's prefix store holds for `scope`."""
        return await self._call(prefix_lookup_call(scope, digests))

    async def admit_prefix(self, session_id: str, epoch: int, scope: str, digests: list[bytes], *, n_ctx: int = 0) -> int:
        """Admit (session_id, epoch) holding the stored prefix of len(digests) blocks, parked; returns its length."""
        return await self._call(admit_prefix_call(session_id, epoch, scope, digests, n_ctx))

    async def export_state(self, session_id: str, epoch: int) -> bytes:
        """The session's sealed state (kvpool.state.header), gathered chunk by chunk; a hot session stays hot."""
        export = StateExport(session_id, epoch)
        while (call := export.next_call()) is not None:
            export.take(await self._call(call))
        return export.state()

    async def import_state(self, session_id: str, epoch: int, state: bytes, *, chunk_bytes: int | None = None) -> int:
        """Admit (session_id, epoch) as parked from an exported state; returns its length (Client.import_state)."""
        length = 0
        if self._hello is None:
            await self._connected()
        for call in import_calls(session_id, epoch, state, chunk_bytes or import_chunk_bytes(self.hello.max_request_bytes)):
            length = await self._call(call)
        return length

    async def cancel(self, session_id: str, epoch: int) -> Done:
        """Abort the session's in-flight append; goes on the side connection, never behind that append."""
        return await self._call(cancel_call(session_id, epoch), "_cancel_connection")

    async def stats(self) -> StatsReply:
        return await self._call(stats_call())

    async def shutdown(self, *, drain: bool = False) -> None:
        """Stop the daemon at once, or with `drain` as on SIGTERM (kvpool.daemon.drain)."""
        await self._call(shutdown_call(drain))

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

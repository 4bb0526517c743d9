"""`kvpool.Client`: the synchronous client a router uses to talk to one shard daemon.

One request at a time per connection (a lock makes a Client safe to share between threads). `cancel()`
goes over a second connection, opened on first use, so it can reach a daemon busy with this client's
own in-flight append.

A reply is returned only to the request that produced it: every request carries a fresh request id
that the reply must echo, and any failure inside a request (a timeout, KeyboardInterrupt, a broken or
undecodable reply) closes that connection, since a reply left unread on it would otherwise answer the
next request. The next call opens a new connection (or raises ConnectionLost if the daemon is gone).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from dataclasses import dataclass
from typing import TypedDict, Unpack

import numpy as np

from kvpool.client_channels import DirectChannels
from kvpool.protocol import (
    FRAME_HEADER,
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
    Append,
    AppendReply,
    Cancel,
    Done,
    ErrorCode,
    ErrorReply,
    Fork,
    Hello,
    HelloReply,
    MissReason,
    OutputRows,
    Park,
    Release,
    Reply,
    RequestMessage,
    Shutdown,
    Stats,
    StatsReply,
    Truncate,
    decode_reply,
    receive_exactly,
    encode,
)
from workers.sampling import Sampling


class KvpoolError(Exception):
    """A typed error reply from the daemon; `code`, `length` and (for cache_miss) `reason` say what."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code}: {reply.message}" + (f" (reason: {reply.reason})" if reply.reason else ""))
        self.reply = reply
        self.code: ErrorCode = reply.code
        self.length = reply.length
        self.reason: MissReason | None = reply.reason


class ConnectionLost(Exception):
    """The daemon closed the connection or could not be reached."""


@dataclass(frozen=True, slots=True)
class AppendResult:
    length: int
    rows: np.ndarray  # float32 [rows, width]: hidden states, or logits on the last shard
    admitted: bool
    restored: bool = False  # the session was parked; its saved state was restored for this append
    token: int | None = None  # with sample=: the token the last shard picked
    top_ids: tuple[int, ...] = ()  # with sample.logprobs: the most likely tokens and their log-probabilities
    top_logprobs: tuple[float, ...] = ()

    @classmethod
    def of(cls, reply: AppendReply) -> AppendResult:
        rows = np.frombuffer(reply.data, dtype="<f4").reshape(reply.rows, reply.width)
        return cls(
            length=reply.length, rows=rows, admitted=reply.admitted, restored=reply.restored,
            token=reply.token if reply.token >= 0 else None, top_ids=tuple(reply.top_ids), top_logprobs=tuple(reply.top_logprobs),
        )


# Shared with kvpool.async_client: what a request is made of, and what its reply must be.


class AppendOptions(TypedDict, total=False):
    """What an append carries besides the session and position: exactly one of tokens (first shard) and
    hidden (float32 [rows, n_embd], elsewhere); output_rows "last" or "all"; n_ctx and admit_timeout_s
    matter when the append admits a new session (0: the daemon's default; 0: answer over_budget at once)."""

    tokens: list[int] | np.ndarray | None
    hidden: np.ndarray | None
    output_rows: str
    n_ctx: int
    admit_timeout_s: float
    sample: Sampling | None


def append_request(
    session_id: str, epoch: int, start_pos: int, *, tokens: list[int] | np.ndarray | None = None, hidden: np.ndarray | None = None,
    output_rows: str = "last", n_ctx: int = 0, admit_timeout_s: float = 0.0, sample: Sampling | None = None, direct: bool = False,
) -> Append:
    return Append(
        session_id=session_id, epoch=epoch, start_pos=start_pos,
        tokens=None if tokens is None else [int(token) for token in tokens],
        hidden=None if hidden is None else np.ascontiguousarray(hidden, dtype="<f4").tobytes(),
        output_rows=OutputRows(output_rows), n_ctx=n_ctx, admit_timeout_s=admit_timeout_s, sample=sample, direct=direct,
    )


def checked_reply(request: RequestMessage, reply: Reply, expected: type) -> Reply:
    """The reply if it is of the expected type; an ErrorReply raises KvpoolError, anything else ConnectionLost."""
    if isinstance(reply, ErrorReply):
        raise KvpoolError(reply)
    if not isinstance(reply, expected):
        raise ConnectionLost(f"the daemon answered {type(request).__name__} with {type(reply).__name__}")
    return reply


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = receive_exactly(sock, size)
    if data is None:
        raise ConnectionLost("the daemon closed the connection")
    return data


class _Connection:
    """One socket to the daemon, after the Hello handshake. Closed for good by any failed request."""

    def __init__(self, path: str, timeout_s: float | None, name: str, *, handshake: bool = True) -> None:
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.lock = threading.Lock()
        self._request_ids = itertools.count(1)
        try:
            self.sock.connect(path)
        except OSError as error:
            self.close()
            raise ConnectionLost(f"cannot connect to {path!r}: {error.strerror or error}") from error
        self.hello: HelloReply | None = None
        if not handshake:
            return  # a worker's direct channel: no handshake (the daemon's Hello vouched for the protocol)
        reply = self.request(Hello(version=PROTOCOL_VERSION, client=name))
        if isinstance(reply, ErrorReply):
            self.close()
            raise KvpoolError(reply)
        if not isinstance(reply, HelloReply):
            self.close()
            raise ConnectionLost(f"the daemon answered Hello with {type(reply).__name__}")
        self.hello = reply

    @property
    def closed(self) -> bool:
        return self.sock is None

    def request(self, message: RequestMessage, request_id: int = 0) -> Reply:
        """Send one request (under `request_id`, or the connection's next) and return its reply; the
        connection is closed if anything goes wrong."""
        with self.lock:
            sock = self.sock
            if sock is None:
                raise ConnectionLost("the connection was closed by an earlier failure")
            request_id = request_id or next(self._request_ids)
            message.request_id = request_id
            try:
                sock.sendall(encode(message))
                (size,) = FRAME_HEADER.unpack(_receive_exactly(sock, FRAME_HEADER.size))
                if size > MAX_REPLY_BYTES:
                    raise ConnectionLost(f"reply of {size} bytes is larger than any valid reply")
                reply = decode_reply(_receive_exactly(sock, size))
            except (BrokenPipeError, ConnectionResetError) as error:
                self.close()
                raise ConnectionLost(f"connection lost: {error}") from error
            except BaseException:
                self.close()
                raise
            if reply.request_id != request_id:
                self.close()
                raise ConnectionLost(f"the daemon answered request {reply.request_id} where request {request_id} was expected")
            return reply

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


class Client:
    """A client of one daemon. With `direct` (the default) it asks for its sessions' direct channels and
    sends their appends straight to the worker, falling back to the daemon whenever a channel is gone."""

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout_s: float | None = 300.0, name: str = "", direct: bool = True) -> None:
        self.socket_path = os.fspath(socket_path)
        self._timeout_s = timeout_s
        self._name = name
        self.direct = direct
        self._channels = DirectChannels(lambda address: _Connection(address, self._timeout_s, self._name, handshake=False), ConnectionLost)
        self._connect_lock = threading.Lock()
        self._main: _Connection | None = None
        self._cancel_connection: _Connection | None = None
        self._closed = False
        self.hello: HelloReply = self._connection("main").hello

    def _connection(self, which: str) -> _Connection:
        """The open main or cancel connection, (re)opened if a failure closed it."""
        attribute = "_main" if which == "main" else "_cancel_connection"
        with self._connect_lock:
            if self._closed:
                raise ConnectionLost("this client is closed")
            connection: _Connection | None = getattr(self, attribute)
            if connection is None or connection.closed:
                connection = _Connection(self.socket_path, self._timeout_s, self._name)
                previous = getattr(self, "hello", None)
                if previous is not None and connection.hello.shard != previous.shard:
                    connection.close()
                    raise ConnectionLost(f"the daemon on {self.socket_path} now serves another shard")
                setattr(self, attribute, connection)
            return connection

    @property
    def shard(self):
        return self.hello.shard

    @property
    def timeout_s(self) -> float | None:
        """Seconds a request may wait for its reply (None: forever); a request that times out closes its
        connection, and the next one reconnects."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float | None) -> None:
        with self._connect_lock:
            self._timeout_s = value
            for connection in (self._main, self._cancel_connection):
                if connection is not None and connection.sock is not None:
                    connection.sock.settimeout(value)
        self._channels.set_timeout(value)

    def _call(self, message: RequestMessage, expected: type) -> Reply:
        return checked_reply(message, self._connection("main").request(message), expected)

    def append(self, session_id: str, epoch: int, start_pos: int, **options: Unpack[AppendOptions]) -> AppendResult:
        request = append_request(session_id, epoch, start_pos, direct=self.direct, **options)
        if self.direct:
            reply = self._channels.request(request)
            if reply is not None:
                return AppendResult.of(checked_reply(request, reply, AppendReply))
        reply = self._call(request, AppendReply)
        self._channels.remember(session_id, epoch, reply.channel)
        return AppendResult.of(reply)

    def truncate(self, session_id: str, epoch: int, length: int) -> int:
        self._channels.forget(session_id, epoch)
        return self._call(Truncate(session_id=session_id, epoch=epoch, length=length), Done).length

    def release(self, session_id: str, epoch: int) -> Done:
        self._channels.forget(session_id, epoch)
        return self._call(Release(session_id=session_id, epoch=epoch), Done)

    def park(self, session_id: str, epoch: int) -> Done:
        """Save the idle session's state to the daemon's spill store and free its context now."""
        self._channels.forget(session_id, epoch)
        return self._call(Park(session_id=session_id, epoch=epoch), Done)

    def fork(self, session_id: str, epoch: int, new_session_id: str, new_epoch: int, length: int) -> Done:
        """A new session holding the source's first `length` positions (parked until its first append)."""
        return self._call(Fork(session_id=session_id, epoch=epoch, new_session_id=new_session_id, new_epoch=new_epoch, length=length), Done)

    def direct_in_flight(self, session_id: str, epoch: int) -> bool:
        """An append of this session was sent on its direct channel and is not answered yet."""
        return bool(self._channels.in_flight(session_id, epoch))

    def cancel(self, session_id: str, epoch: int) -> Done:
        """Abort the session's in-flight append (sent on a side connection; safe from another thread)."""
        request = Cancel(session_id=session_id, epoch=epoch, direct_request_id=self._channels.in_flight(session_id, epoch))
        return checked_reply(request, self._connection("cancel").request(request), Done)

    def stats(self) -> StatsReply:
        return self._call(Stats(), StatsReply)

    def shutdown(self) -> None:
        self._call(Shutdown(), Done)

    def close(self) -> None:
        self._channels.close()
        with self._connect_lock:
            self._closed = True
            for connection in (self._main, self._cancel_connection):
                if connection is not None:
                    connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

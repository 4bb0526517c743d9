"""`kvpool.Client`: the synchronous client a router uses to talk to one shard daemon.

One request at a time per connection (a lock makes a Client safe to share between threads). `cancel()`
goes over a second connection, opened on first use, so it can reach a daemon busy with this client's
own in-flight append.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

import numpy as np

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
    Hello,
    HelloReply,
    Message,
    MissReason,
    OutputRows,
    Release,
    Reply,
    Shutdown,
    Stats,
    StatsReply,
    Truncate,
    decode_reply,
    encode,
)


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


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionLost("the daemon closed the connection")
        received += count
    return bytes(buffer)


class _Connection:
    def __init__(self, path: str, timeout_s: float | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(path)
        except OSError as error:
            self.sock.close()
            raise ConnectionLost(f"cannot connect to {path}: {error.strerror or error}") from error
        self.lock = threading.Lock()

    def request(self, message: Message) -> Reply:
        return self.request_raw(encode(message))

    def request_raw(self, frame: bytes) -> Reply:
        with self.lock:
            try:
                self.sock.sendall(frame)
                (size,) = FRAME_HEADER.unpack(_receive_exactly(self.sock, FRAME_HEADER.size))
                if size > MAX_REPLY_BYTES:
                    raise ConnectionLost(f"reply of {size} bytes is larger than any valid reply")
                return decode_reply(_receive_exactly(self.sock, size))
            except (BrokenPipeError, ConnectionResetError) as error:
                raise ConnectionLost(f"connection lost: {error}") from error

    def close(self) -> None:
        self.sock.close()


class Client:
    def __init__(self, socket_path: str | os.PathLike[str], *, timeout_s: float | None = 300.0, name: str = "") -> None:
        self.socket_path = os.fspath(socket_path)
        self._timeout_s = timeout_s
        self._name = name
        self._main = self._connect()
        self._cancel_connection: _Connection | None = None
        self._cancel_lock = threading.Lock()

    def _connect(self) -> _Connection:
        connection = _Connection(self.socket_path, self._timeout_s)
        try:
            reply = connection.request(Hello(version=PROTOCOL_VERSION, client=self._name))
        except BaseException:
            connection.close()
            raise
        if isinstance(reply, ErrorReply):
            connection.close()
            raise KvpoolError(reply)
        assert isinstance(reply, HelloReply)
        self.hello = reply
        return connection

    @property
    def shard(self):
        return self.hello.shard

    def _call(self, message: Message, expected: type) -> Reply:
        reply = self._main.request(message)
        if isinstance(reply, ErrorReply):
            raise KvpoolError(reply)
        assert isinstance(reply, expected), reply
        return reply

    def append(
        self,
        session_id: str,
        epoch: int,
        start_pos: int,
        *,
        tokens: list[int] | np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        output_rows: str = "last",
        n_ctx: int = 0,
        admit_timeout_s: float = 0.0,
    ) -> AppendResult:
        hidden_bytes = None
        if hidden is not None:
            hidden_bytes = np.ascontiguousarray(hidden, dtype="<f4").tobytes()
        token_list = None if tokens is None else [int(token) for token in tokens]
        reply = self._call(
            Append(
                session_id=session_id, epoch=epoch, start_pos=start_pos, tokens=token_list, hidden=hidden_bytes,
                output_rows=OutputRows(output_rows), n_ctx=n_ctx, admit_timeout_s=admit_timeout_s,
            ),
            AppendReply,
        )
        rows = np.frombuffer(reply.data, dtype="<f4").reshape(reply.rows, reply.width)
        return AppendResult(length=reply.length, rows=rows, admitted=reply.admitted)

    def truncate(self, session_id: str, epoch: int, length: int) -> int:
        return self._call(Truncate(session_id=session_id, epoch=epoch, length=length), Done).length

    def release(self, session_id: str, epoch: int) -> Done:
        return self._call(Release(session_id=session_id, epoch=epoch), Done)

    def cancel(self, session_id: str, epoch: int) -> Done:
        """Abort the session's in-flight append (sent on a side connection; safe from another thread)."""
        with self._cancel_lock:
            if self._cancel_connection is None:
                self._cancel_connection = self._connect()
            reply = self._cancel_connection.request(Cancel(session_id=session_id, epoch=epoch))
        if isinstance(reply, ErrorReply):
            raise KvpoolError(reply)
        assert isinstance(reply, Done)
        return reply

    def stats(self) -> StatsReply:
        return self._call(Stats(), StatsReply)

    def shutdown(self) -> None:
        self._call(Shutdown(), Done)

    def close(self) -> None:
        self._main.close()
        if self._cancel_connection is not None:
            self._cancel_connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""One socket of the synchronous client (kvpool.client.client): to a daemon, after the Hello handshake, or to a
worker's direct channel, without one. Requests are framed by kvpool.wire.protocol and go one at a time.

A reply is returned only to the request that produced it: every request carries a fresh request id that
the reply must echo, and any failure inside a request (a timeout, KeyboardInterrupt, a broken or
undecodable reply) closes the connection for good, since a reply left unread on it would otherwise
answer the next request.
"""

from __future__ import annotations

import itertools
import socket
import threading

from kvpool.client.messages import ConnectionLost, KvpoolError
from kvpool.wire.protocol import (
    FRAME_HEADER,
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    HelloReply,
    Reply,
    RequestMessage,
    decode_reply,
    encode,
    receive_exactly,
)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = receive_exactly(sock, size)
    if data is None:
        raise ConnectionLost("the daemon closed the connection")
    return data


class ClientConnection:
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

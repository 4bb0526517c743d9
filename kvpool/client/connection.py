"""One socket of the synchronous client (kvpool.client.client): to a daemon, after the Hello handshake, or to a
worker's direct channel, without one. Requests are framed by kvpool.wire.framing and go one at a time.

A reply is returned only to the request that produced it: every request carries a fresh request id that
the reply must echo, and any failure inside a request (a timeout, KeyboardInterrupt, a broken or
undecodable reply) closes the connection for good, since a reply left unread on it would otherwise
answer the next request.
"""

from __future__ import annotations

import itertools
import socket
import threading

from kvpool.client.messages import ConnectionLost, hello_call
from kvpool.wire.framing import FrameError, receive_frame
from kvpool.wire.protocol import MAX_REPLY_BYTES, HelloReply, Reply, RequestMessage, decode_reply, encode


def _receive_reply(sock: socket.socket) -> Reply:
    try:
        payload = receive_frame(sock, MAX_REPLY_BYTES)
    except FrameError as error:
        raise ConnectionLost(f"unreadable reply: {error}") from error
    if payload is None:
        raise ConnectionLost("the daemon closed the connection")
    return decode_reply(payload)


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
        call = hello_call(name)
        try:
            self.hello = call.outcome(self.request(call.request))
        except BaseException:
            self.close()
            raise

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
                reply = _receive_reply(sock)
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

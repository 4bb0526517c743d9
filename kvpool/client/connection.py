"""One socket of the synchronous client (kvpool.client.client): to a daemon, after the Hello handshake, or to a
worker's direct channel, without one. Requests are framed by kvpool.wire.framing and go one at a time.

A reply is returned only to the request that produced it: every request carries a fresh request id that
the reply must echo, and any failure inside a request (a timeout, KeyboardInterrupt, a broken or
undecodable reply) closes the connection for good, since a reply left unread on it would otherwise
answer the next request. A failure before the whole request frame left (the connection could not be
opened, the daemon had closed it, or its farewell after a drain waits there unread) raises
RequestNotSent: the daemon took nothing of that request.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading

from kvpool.client.messages import ConnectionLost, KvpoolError, RequestNotSent, hello_call, is_farewell
from kvpool.wire.framing import FrameError, FrameTooLarge, frame_size, receive_frame
from kvpool.wire.protocol import MAX_REPLY_BYTES, ErrorCode, ErrorReply, HelloReply, Reply, RequestMessage, decode_reply, encode


def _receive_reply(sock: socket.socket, reuse: bytearray | None = None) -> Reply:
    try:
        payload = receive_frame(sock, MAX_REPLY_BYTES, reuse)
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
        self.farewell_seen = False  # the daemon drained while a request was in flight here
        self._request_ids = itertools.count(1)
        self._received = bytearray()  # replies are read into it (kvpool.wire.framing.receive_frame's reuse)
        try:
            self.sock.connect(path)
        except OSError as error:
            self.close()
            raise RequestNotSent(f"cannot connect to {path!r}: {error.strerror or error}") from error
        self._poller = select.poll()  # _check_still_open's, made once: it asks before every request
        self._poller.register(self.sock, select.POLLIN)
        self.hello: HelloReply | None = None
        if not handshake:
            return  # a worker's direct channel: no handshake (the daemon's Hello vouched for the protocol)
        call = hello_call(name)
        try:
            self.hello = call.outcome(self.request(call.request))
        except ConnectionLost as lost:  # no request of the caller's was sent yet
            self.close()
            raise RequestNotSent(f"the handshake failed: {lost}", drained=getattr(lost, "drained", False)) from lost
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
            return self.receive(self.send(message, request_id))

    def send(self, message: RequestMessage, request_id: int = 0) -> int:
        """The first half of `request`, its caller holding `lock` until `receive` has read the reply: the
        request sent under `request_id` (or the connection's next), which is returned."""
        sock = self.sock
        if sock is None:
            raise ConnectionLost("the connection was closed by an earlier failure")
        request_id = request_id or next(self._request_ids)
        message.request_id = request_id
        self._check_still_open(sock)
        frame = encode(message)
        if self.hello is not None:
            try:  # the daemon would refuse it unread and close the connection: the same refusal, typed, nothing sent
                frame_size(frame, self.hello.max_request_bytes)  # the header at the frame's start
            except FrameTooLarge as refused:
                raise KvpoolError(ErrorReply(code=ErrorCode.BAD_REQUEST, message=str(refused), request_id=request_id)) from None
        try:
            sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError) as error:  # a frame that did not leave whole is never read
            self.close()
            raise RequestNotSent(f"connection lost: {error}") from error
        except BaseException:
            self.close()
            raise
        return request_id

    def receive(self, request_id: int) -> Reply:
        """The second half of `request`: the reply to the request `send` sent as `request_id`."""
        sock = self.sock
        if sock is None:
            raise ConnectionLost("the connection was closed by an earlier failure")
        try:
            reply = _receive_reply(sock, self._received)
        except (BrokenPipeError, ConnectionResetError) as error:
            self.close()
            raise ConnectionLost(f"connection lost: {error}") from error
        except BaseException:
            self.close()
            raise
        if reply.request_id != request_id:
            self.close()
            if is_farewell(reply):
                self.farewell_seen = True
                raise ConnectionLost(f"the daemon drained while the request was in flight: {reply.message}")
            raise ConnectionLost(f"the daemon answered request {reply.request_id} where request {request_id} was expected")
        return reply

    def _check_still_open(self, sock: socket.socket) -> None:
        """Before a request leaves: nothing may wait on the connection but a daemon's end of it (end of
        file, or its farewell after a drain); either closes it and raises RequestNotSent."""
        if not self._poller.poll(0):
            return  # nothing there: the usual case (a socket with a timeout would wait in recv, poll does not)
        try:
            waiting = sock.recv(1, socket.MSG_PEEK)
        except OSError as error:
            self.close()
            raise RequestNotSent(f"connection lost: {error}") from error
        drained = False
        if waiting:
            try:
                drained = is_farewell(_receive_reply(sock))
            except Exception:  # noqa: BLE001 - whatever it was, the connection is done
                pass
        self.close()
        raise RequestNotSent("the daemon drained and closed the connection" if drained else "the daemon closed the connection", drained=drained)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self._received = bytearray()  # a closed connection kept by its owner (a gone worker's direct channel) holds no reply buffer
        if sock is not None:
            sock.close()

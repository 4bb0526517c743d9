"""A client's direct channels: which of its sessions a daemon bound to a worker's direct channel, and one
connection per worker. A request on a channel that is gone (revoked by the supervisor, or the worker's
connection lost) is not an error: the client asks the daemon instead, and its answer is the contract's."""

from __future__ import annotations

import itertools
import secrets
import threading

from kvpool.wire.protocol import Append, ErrorCode, ErrorReply, Reply

REQUEST_ID_MASK = 2**62 - 1


class DirectChannels:
    def __init__(self, connect, lost: type[Exception]) -> None:
        self._connect = connect  # address -> an open connection (kvpool.client.connection.ClientConnection, no handshake)
        self._lost = lost  # what a connection raises when its peer is gone
        self._lock = threading.Lock()
        self._address_of: dict[tuple[str, int], str] = {}
        self._connections: dict[str, object] = {}
        self._in_flight: dict[tuple[str, int], int] = {}  # the request id of a session's append on its channel
        self._closed = False
        self._request_ids = itertools.count(secrets.randbits(62) | 1, 2)  # from a random odd start: no syscall a request

    def remember(self, session_id: str, epoch: int, address: str) -> None:
        if address:
            with self._lock:
                self._address_of[(session_id, epoch)] = address

    def forget(self, session_id: str, epoch: int) -> None:
        with self._lock:
            self._address_of.pop((session_id, epoch), None)

    def request(self, message: Append) -> Reply | None:
        """The reply from the session's worker, or None: no channel (any more) - ask the daemon."""
        key = (message.session_id, message.epoch)
        with self._lock:
            address = self._address_of.get(key)
            if address is None or self._closed:
                return None
            connection = self._connections.get(address)
        if connection is None or connection.closed:
            try:
                connection = self._connect("\0" + address)
            except self._lost:
                self.forget(*key)
                return None
            with self._lock:
                self._connections[address] = connection
        request_id = self._next_request_id()
        with self._lock:
            self._in_flight[key] = request_id
        try:
            reply = connection.request(message, request_id)
        except self._lost:  # the worker is gone: the daemon knows what became of the session
            self.forget(*key)
            return None
        finally:
            with self._lock:
                self._in_flight.pop(key, None)
        if isinstance(reply, ErrorReply) and reply.code == ErrorCode.CHANNEL_REVOKED:
            self.forget(*key)
            return None
        return reply

    def _next_request_id(self) -> int:
        """Odd, so never 0, within the wire's 62 bits, and not repeated by this client for 2^61 requests: a cancel
        names a direct append by it, across this client's connections."""
        return next(self._request_ids) & REQUEST_ID_MASK

    def in_flight(self, session_id: str, epoch: int) -> int:
        """The request id of the session's append in flight on its channel (0: none)."""
        with self._lock:
            return self._in_flight.get((session_id, epoch), 0)

    def set_timeout(self, value: float | None) -> None:
        with self._lock:
            for connection in self._connections.values():
                if connection.sock is not None:
                    connection.sock.settimeout(value)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections.values()), {}
            self._address_of.clear()
        for connection in connections:
            connection.close()

"""`kvpool.Client`: the synchronous client a router uses to talk to one shard daemon.

One request at a time per connection (a lock makes a Client safe to share between threads). `cancel()`
goes over a second connection, opened on first use, so it can reach a daemon busy with this client's
own in-flight append. A connection that a failed request closed (kvpool.client.connection) is reopened
by the next call, or that call raises ConnectionLost if the daemon is gone.
"""

from __future__ import annotations

import os
import threading
from typing import Unpack

from kvpool.client.channels import DirectChannels
from kvpool.client.connection import ClientConnection
from kvpool.client.messages import (
    AppendOptions,
    AppendResult,
    Call,
    ConnectionLost,
    KvpoolError,
    Result,
    append_call,
    append_request,
    cancel_call,
    checked_reply,
    fork_call,
    park_call,
    release_call,
    shutdown_call,
    stats_call,
    truncate_call,
)
from kvpool.wire.protocol import Done, HelloReply, StatsReply

__all__ = ["AppendOptions", "AppendResult", "Client", "ConnectionLost", "KvpoolError", "append_request", "checked_reply"]


class Client:
    """A client of one daemon. With `direct` (the default) it asks for its sessions' direct channels and
    sends their appends straight to the worker, falling back to the daemon whenever a channel is gone."""

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout_s: float | None = 300.0, name: str = "", direct: bool = True) -> None:
        self.socket_path = os.fspath(socket_path)
        self._timeout_s = timeout_s
        self._name = name
        self.direct = direct
        self._channels = DirectChannels(lambda address: ClientConnection(address, self._timeout_s, self._name, handshake=False), ConnectionLost)
        self._connect_lock = threading.Lock()
        self._main: ClientConnection | None = None
        self._cancel_connection: ClientConnection | None = None
        self._closed = False
        self.hello: HelloReply = self._connection("main").hello

    def _connection(self, which: str) -> ClientConnection:
        """The open main or cancel connection, (re)opened if a failure closed it."""
        attribute = "_main" if which == "main" else "_cancel_connection"
        with self._connect_lock:
            if self._closed:
                raise ConnectionLost("this client is closed")
            connection: ClientConnection | None = getattr(self, attribute)
            if connection is None or connection.closed:
                connection = ClientConnection(self.socket_path, self._timeout_s, self._name)
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

    def _call(self, call: Call[Result], which: str = "main") -> Result:
        return call.outcome(self._connection(which).request(call.request))

    def append(self, session_id: str, epoch: int, start_pos: int, **options: Unpack[AppendOptions]) -> AppendResult:
        call = append_call(session_id, epoch, start_pos, direct=self.direct, **options)
        if self.direct:
            reply = self._channels.request(call.request)
            if reply is not None:
                return call.outcome(reply)
        reply = call.checked(self._connection("main").request(call.request))
        self._channels.remember(session_id, epoch, reply.channel)
        return call.result(reply)

    def truncate(self, session_id: str, epoch: int, length: int) -> int:
        self._channels.forget(session_id, epoch)
        return self._call(truncate_call(session_id, epoch, length))

    def release(self, session_id: str, epoch: int) -> Done:
        self._channels.forget(session_id, epoch)
        return self._call(release_call(session_id, epoch))

    def park(self, session_id: str, epoch: int) -> Done:
        """Save the idle session's state to the daemon's spill store and free its context now."""
        self._channels.forget(session_id, epoch)
        return self._call(park_call(session_id, epoch))

    def fork(self, session_id: str, epoch: int, new_session_id: str, new_epoch: int, length: int) -> Done:
        """A new session holding the source's first `length` positions (parked until its first append)."""
        return self._call(fork_call(session_id, epoch, new_session_id, new_epoch, length))

    def direct_in_flight(self, session_id: str, epoch: int) -> bool:
        """An append of this session was sent on its direct channel and is not answered yet."""
        return bool(self._channels.in_flight(session_id, epoch))

    def cancel(self, session_id: str, epoch: int) -> Done:
        """Abort the session's in-flight append (sent on a side connection; safe from another thread)."""
        return self._call(cancel_call(session_id, epoch, self._channels.in_flight(session_id, epoch)), "cancel")

    def stats(self) -> StatsReply:
        return self._call(stats_call())

    def shutdown(self) -> None:
        self._call(shutdown_call())

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

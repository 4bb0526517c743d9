"""`kvpool.Client`: the synchronous client a router uses to talk to one shard daemon.

One request at a time per connection (a lock makes a Client safe to share between threads). `cancel()`
goes over a second connection, opened on first use, so it can reach a daemon busy with this client's
own in-flight append. A connection that a failed request closed (kvpool.client.connection) is reopened
by the next call, or that call raises ConnectionLost if the daemon is gone. Once the daemon has said it
drains (a `draining` reply, or its farewell on the connection), a request it took nothing of is sent again
to the daemon that takes over the socket, waiting for one up to `successor_wait_s` (kvpool.client.successor).
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from collections.abc import Sequence
from typing import Unpack

from kvpool.client.channels import DirectChannels
from kvpool.client.connection import ClientConnection
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
    append_request,
    cancel_call,
    checked_reply,
    fork_call,
    import_calls,
    import_chunk_bytes,
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
from kvpool.wire.protocol import Done, ErrorReply, HelloReply, Reply, RequestMessage, StatsReply

__all__ = ["AppendOptions", "AppendResult", "Client", "ConnectionLost", "KvpoolError", "append_request", "checked_reply"]


class Client:
    """A client of one daemon. With `direct` (the default) it asks for its sessions' direct channels and
    sends their appends straight to the worker, falling back to the daemon whenever a channel is gone."""

    # the Hello of the daemon last connected to: one that took over the socket (a drain's successor, a restart)
    # serves the same shard, or is refused, but may keep another prefix block or context (kvpool.router.prefix)
    hello: HelloReply

    def __init__(
        self, socket_path: str | os.PathLike[str], *, timeout_s: float | None = 300.0, name: str = "", direct: bool = True,
        successor_wait_s: float = DEFAULT_WAIT_S, on_successor_wait: Say | None = None,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.successor_wait_s = successor_wait_s  # after a drain: how long to wait for the daemon that follows
        self.on_successor_wait = on_successor_wait  # told where that wait stands every 15 s (None: silent)
        self._drained = False  # the daemon said it drains: a successor is expected on the socket
        self._timeout_s = timeout_s
        self._name = name
        self.direct = direct
        self._channels = DirectChannels(lambda address: ClientConnection(address, self._timeout_s, self._name, handshake=False), ConnectionLost)
        self._connect_lock = threading.Lock()
        self._main: ClientConnection | None = None
        self._cancel_connection: ClientConnection | None = None
        self._closed = False
        self._connection("main")

    def _connection(self, which: str) -> ClientConnection:
        """The open main or cancel connection, (re)opened if a failure closed it."""
        attribute = "_main" if which == "main" else "_cancel_connection"
        with self._connect_lock:
            if self._closed:
                raise ConnectionLost("this client is closed")
            connection: ClientConnection | None = getattr(self, attribute)
            if connection is not None and connection.farewell_seen:
                self._drained = True  # its daemon said farewell: wait for the one that follows
            if connection is None or connection.closed:
                connection = ClientConnection(self.socket_path, self._timeout_s, self._name)
                assert connection.hello is not None
                previous: HelloReply | None = getattr(self, "hello", None)
                if previous is not None and connection.hello.shard != previous.shard:
                    connection.close()
                    raise ConnectionLost(f"the daemon on {self.socket_path} now serves another shard")
                setattr(self, attribute, connection)
                self.hello = connection.hello
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
        return call.outcome(self._request(call.request, which))

    def _request(self, message: RequestMessage, which: str = "main") -> Reply:
        """The reply to `message`; after a drain, sent again (to the daemon that follows) as long as no
        daemon took anything of it, within the successor wait."""
        wait: SuccessorWait | None = None
        while True:
            try:
                reply = self._connection(which).request(message)
            except RequestNotSent as lost:
                if not self._to_send_again(lost):
                    raise
                wait = wait or SuccessorWait(self.socket_path, self.successor_wait_s, self.on_successor_wait)
                time.sleep(wait.pause_s(lost))
                continue
            if self._answered(reply, which):
                return reply
            assert isinstance(reply, ErrorReply)
            wait = wait or SuccessorWait(self.socket_path, self.successor_wait_s, self.on_successor_wait)
            time.sleep(wait.pause_s(KvpoolError(reply), reply.retry_after_s))

    def _to_send_again(self, lost: RequestNotSent) -> bool:
        """Whether a request that never left (`lost`) is sent again: once its daemon has drained, to the one
        that follows (within the successor wait)."""
        self._drained = self._drained or lost.drained
        return self._drained and not self._closed

    def _answered(self, reply: Reply, which: str) -> bool:
        """True for a reply to keep; False for a draining daemon's answer that the request is to be sent
        again (that daemon's connection closed: the next try opens a new one)."""
        if not to_send_again(reply):
            self._drained = False  # a daemon serves the socket again
            return True
        self._drained = True
        self._close_connection(which)
        return False

    def _close_connection(self, which: str) -> None:
        with self._connect_lock:
            connection = self._main if which == "main" else self._cancel_connection
            if connection is not None:
                connection.close()

    def append(self, session_id: str, epoch: int, start_pos: int, **options: Unpack[AppendOptions]) -> AppendResult:
        call = append_call(session_id, epoch, start_pos, direct=self.direct, **options)
        if self.direct:
            reply = self._channels.request(call.request)
            if reply is not None:
                return call.outcome(reply)
        reply = call.checked(self._request(call.request))
        self._channels.remember(session_id, epoch, reply.channel)
        return call.result(reply)

    def truncate(self, session_id: str, epoch: int, length: int) -> int:
        self._channels.forget(session_id, epoch)
        return self._call(truncate_call(session_id, epoch, length))

    def release(self, session_id: str, epoch: int) -> Done:
        self._channels.forget(session_id, epoch)
        return self._call(release_call(session_id, epoch))

    def park(self, session_id: str, epoch: int, *, wait: bool = True) -> Done:
        """Save the idle session's state to the daemon's spill store and free its context now; without
        `wait` answered once the save has begun ("parking"; kvpool.wire.protocol.Park)."""
        return self._call(self.parking(session_id, epoch, wait=wait))

    def parking(self, session_id: str, epoch: int, *, wait: bool = True) -> Call[Done]:
        """The park's call, for Client.ask_all; the session's direct channel is forgotten here first (a
        parked session's next append goes to the daemon, which restores it)."""
        self._channels.forget(session_id, epoch)
        return park_call(session_id, epoch, wait)

    def restore(self, session_id: str, epoch: int, *, admit_timeout_s: float = 0.0) -> Done:
        """Make the parked session hot again now ("restored"; "hot": it was not parked), so its next append
        computes at once (kvpool.wire.protocol.Restore); room waited for up to `admit_timeout_s`."""
        return self._call(self.restoring(session_id, epoch, admit_timeout_s=admit_timeout_s))

    def restoring(self, session_id: str, epoch: int, *, admit_timeout_s: float = 0.0) -> Call[Done]:
        """The restore's call, for Client.ask_all: with `direct` (the client's) the daemon binds the session to
        its worker's direct channel, remembered here as an append's reply binds it."""
        self._channels.forget(session_id, epoch)  # a failed Restore, or one answered without a channel, leaves none behind
        call = restore_call(session_id, epoch, direct=self.direct, admit_timeout_s=admit_timeout_s)

        def done(reply: Done) -> Done:
            self._channels.remember(session_id, epoch, reply.channel)
            return reply

        return Call(call.request, call.expects, done)

    @staticmethod
    def ask_all(calls: Sequence[tuple[Client, Call[Result]]]) -> list[Result | Exception]:
        """Every call's request sent to its client's daemon first, then every reply read as it comes, in one
        thread: the round trips overlap, so requests each daemon answers at once (Park without wait) cost
        about one round trip together. Each entry is the call's result or the error it met (KvpoolError,
        ConnectionLost, a socket timeout). A request that could not leave, or that a draining daemon asks to
        be sent again, is then asked alone as every call is (Client._request: the successor wait). Each
        client's main connection is held from its request's send until its reply is read (taken in one
        order, so two callers never wait on each other); a reply left unread by an interruption closes its
        connection. A client appears once."""
        if len({id(client) for client, _ in calls}) != len(calls):
            raise ValueError("ask_all takes each client once")
        results: list = [None] * len(calls)
        alone: list[int] = []

        def not_sent(index: int, lost: RequestNotSent) -> None:
            if calls[index][0]._to_send_again(lost):
                alone.append(index)
            else:
                results[index] = lost

        connections: dict[int, ClientConnection] = {}
        for index, (client, _) in enumerate(calls):
            try:
                connections[index] = client._connection("main")
            except RequestNotSent as lost:
                not_sent(index, lost)
            except ConnectionLost as error:
                results[index] = error
        for connection in sorted(connections.values(), key=id):
            connection.lock.acquire()
        held = dict(connections)  # locks held, by call index
        sent: dict[int, int] = {}  # request ids sent, by call index: replies still to read
        try:
            for index, connection in connections.items():
                try:
                    sent[index] = connection.send(calls[index][1].request)
                except RequestNotSent as lost:
                    not_sent(index, lost)
                except Exception as error:  # noqa: BLE001 - this entry's error; the others are still answered
                    results[index] = error
                if index not in sent:
                    held.pop(index).lock.release()
            with selectors.DefaultSelector() as selector:
                for index in sent:
                    selector.register(connections[index].sock, selectors.EVENT_READ, index)
                while sent:
                    ready = [key.data for key, _ in selector.select(_shortest_timeout(connections[index] for index in sent))]
                    for index in ready or [next(iter(sent))]:  # none ready in time: the first one's own read times out
                        connection = connections[index]
                        selector.unregister(connection.sock)
                        try:
                            reply = connection.receive(sent.pop(index))
                        except Exception as error:  # noqa: BLE001 - as above
                            results[index] = error
                            continue
                        finally:
                            held.pop(index).lock.release()
                        client, call = calls[index]
                        if not client._answered(reply, "main"):
                            alone.append(index)
                            continue
                        try:
                            results[index] = call.outcome(reply)
                        except KvpoolError as error:
                            results[index] = error
        finally:
            for index in sent:  # interrupted (KeyboardInterrupt): a reply left unread must never answer a later request
                connections[index].close()
            for connection in held.values():
                connection.lock.release()
        for index in sorted(alone):
            client, call = calls[index]
            try:
                results[index] = call.outcome(client._request(call.request))
            except (KvpoolError, ConnectionLost) as error:
                results[index] = error
        return results

    def fork(self, session_id: str, epoch: int, new_session_id: str, new_epoch: int, length: int) -> Done:
        """A new session holding the source's first `length` positions (parked until its first append)."""
        return self._call(fork_call(session_id, epoch, new_session_id, new_epoch, length))

    def lookup_prefix(self, scope: str, digests: list[bytes]) -> int:
        """How many leading blocks of `digests` (kvpool.wire.prefix) the daemon's prefix store holds for `scope`."""
        return self._call(prefix_lookup_call(scope, digests))

    def admit_prefix(self, session_id: str, epoch: int, scope: str, digests: list[bytes], *, n_ctx: int = 0) -> int:
        """Admit (session_id, epoch) holding the stored prefix of len(digests) blocks, parked; returns its length
        (its next append starts there). KvpoolError cache_miss prefix_evicted when the store no longer holds it."""
        return self._call(admit_prefix_call(session_id, epoch, scope, digests, n_ctx))

    def export_state(self, session_id: str, epoch: int) -> bytes:
        """The session's sealed state (kvpool.state.header), gathered chunk by chunk; a hot session stays hot."""
        export = StateExport(session_id, epoch)
        while (call := export.next_call()) is not None:
            export.take(self._call(call))
        return export.state()

    def import_state(self, session_id: str, epoch: int, state: bytes, *, chunk_bytes: int | None = None) -> int:
        """Admit (session_id, epoch) as parked from an exported state (of a daemon with this shard's identity);
        returns its length: its next append starts there. `chunk_bytes`: state bytes per Import frame."""
        length = 0
        for call in import_calls(session_id, epoch, state, chunk_bytes or import_chunk_bytes(self.hello.max_request_bytes)):
            length = self._call(call)
        return length

    def direct_in_flight(self, session_id: str, epoch: int) -> bool:
        """An append of this session was sent on its direct channel and is not answered yet."""
        return bool(self._channels.in_flight(session_id, epoch))

    def cancel(self, session_id: str, epoch: int) -> Done:
        """Abort the session's in-flight append (sent on a side connection; safe from another thread)."""
        return self._call(cancel_call(session_id, epoch, self._channels.in_flight(session_id, epoch)), "cancel")

    def stats(self) -> StatsReply:
        return self._call(stats_call())

    def shutdown(self, *, drain: bool = False) -> None:
        """Stop the daemon at once, or with `drain` as on SIGTERM (kvpool.daemon.drain)."""
        self._call(shutdown_call(drain))

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


def _shortest_timeout(connections) -> float | None:
    """The shortest read timeout of `connections`' sockets (None: they wait as long as it takes)."""
    timeouts = [connection.sock.gettimeout() for connection in connections if connection.sock is not None]
    timeouts = [timeout for timeout in timeouts if timeout is not None]
    return min(timeouts) if timeouts else None

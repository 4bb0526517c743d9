"""A worker's direct channel: a Unix socket (abstract namespace, same-uid peers only) on which a router's
client sends the appends of the one session the supervisor bound to this worker, without the supervisor in
between. Frames and messages are the daemon's own (kvpool.wire.protocol); anything but an Append of the bound
session is answered channel_revoked, and the client then asks the supervisor, whose answer is the typed
error of the contract.

The channel never waits on a peer: its sockets are non-blocking, read and written from the worker's one
loop (workers.server.main) only as far as they are ready, so the supervisor's pipe commands are served between
any two reads. A frame, in (a request) or out (its reply), must pass whole within the frame deadline of
the worker waiting for that peer (time it spends computing or serving the pipe is not the peer's), or
the peer is dropped. A peer's buffer grows with the bytes it has sent, not with the size its header
claims."""

from __future__ import annotations

import ctypes
import selectors
import socket
import time
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvpool.wire.checks import append_rows, check_position
from kvpool.wire.errors import RequestFailed
from kvpool.wire.framing import FRAME_HEADER, REUSED_PAYLOAD_BYTES, FrameTooLarge, FrameTruncated, frame_size
from kvpool.wire.peers import same_user
from kvpool.wire.protocol import Append, AppendReply, ErrorCode, ErrorReply, Message, encode_into
from workers.runtime.errors import ShardRuntimeError
from workers.runtime.sampling import answer
from workers.server.direct_cancels import DirectCancels
from workers.server.direct_words import DirectWords
from workers.server.keep_warm_stamp import Stamp
from workers.server.segment import ABORT_FLAG_OFFSET
from workers.server.spec import FRAME_DEADLINE_S, MAX_FRAME_BYTES

if TYPE_CHECKING:
    from workers.server.single import WorkerServer

FIRST_PAYLOAD_BYTES = 64 * 1024  # a payload's buffer starts at this size (or the frame's) and doubles as bytes arrive


class PeerGone(Exception):
    """The peer closed or broke its socket, or broke the framing rule (kvpool.wire.framing) with a frame over
    its channel's largest (WorkerSpec.max_request_bytes) or cut short: drop it."""


def listen(address: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address)
    listener.listen(16)
    listener.setblocking(False)
    return listener


def accept_same_uid(listener: socket.socket) -> socket.socket | None:
    try:
        connection, _ = listener.accept()
    except BlockingIOError:
        return None
    if not same_user(connection):
        connection.close()
        return None
    connection.setblocking(False)
    return connection


class Peer:
    """One accepted connection and the frame passing on it: a request being read (its header, then its
    payload) or a reply being written. Idle between frames; `waited_s` counts the worker's waiting on the
    frame passing now."""

    def __init__(self, connection: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.connection = connection
        self.max_frame_bytes = max_frame_bytes
        self.waited_s = 0.0
        self.closing = False  # the reply being written is the last: drop the peer once it is out
        self._outgoing: memoryview | None = None
        # each reply is encoded here (the last shard's logits every step: no new allocation); kept while its frame is at
        # most REUSED_PAYLOAD_BYTES (msgspec grows it by half again: up to ~1.5x that stays allocated a peer)
        self._frame = bytearray()
        self._start_part(FRAME_HEADER.size, in_header=True)

    @property
    def idle(self) -> bool:
        return self._outgoing is None and self._in_header and self._received == 0

    @property
    def writing(self) -> bool:
        return self._outgoing is not None

    def receive(self) -> bytearray | None:
        """Read what has arrived, without waiting; the payload once the frame is whole, else None."""
        while True:
            if self._received == self._expected:
                if not self._in_header:
                    return self._finish_frame()
                try:
                    size = frame_size(self._buffer, self.max_frame_bytes)
                except FrameTooLarge as error:
                    raise PeerGone(str(error)) from None
                self._start_part(size, in_header=False)
                continue
            if self._received == len(self._buffer):
                self._buffer += bytes(min(len(self._buffer), self._expected - len(self._buffer)))
            with memoryview(self._buffer) as view, view[self._received :] as free:
                try:
                    count = self.connection.recv_into(free)
                except (BlockingIOError, InterruptedError):
                    return None
                except OSError as error:
                    raise PeerGone(str(error)) from None
            if count == 0:
                part = "header" if self._in_header else "payload"
                raise PeerGone("closed" if self.idle else str(FrameTruncated(part, self._received, self._expected)))
            self._received += count

    def write(self, reply: Message) -> None:
        """Start writing `reply` (to the request just read) and write what the socket takes. A peer writes one reply
        at a time: it reads no request while it writes (DirectChannel.ready), so nothing views its buffer here."""
        assert self._outgoing is None, "one reply at a time: the last one's frame is still being written"
        self._outgoing = memoryview(encode_into(reply, self._frame))
        self.waited_s = 0.0
        self.flush()

    def flush(self) -> None:
        """Write what the socket takes of the frame being written, without waiting."""
        while self._outgoing is not None:
            try:
                sent = self.connection.send(self._outgoing)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                raise PeerGone(str(error)) from None
            self._outgoing = self._outgoing[sent:] if sent < len(self._outgoing) else None
        if len(self._frame) > REUSED_PAYLOAD_BYTES:  # a large reply's buffer (a prefill's rows) is not kept for the next
            self._frame = bytearray()
        self.waited_s = 0.0

    def _start_part(self, size: int, *, in_header: bool) -> None:
        self._in_header = in_header
        self._expected = size
        self._buffer = bytearray(min(size, FIRST_PAYLOAD_BYTES))
        self._received = 0

    def _finish_frame(self) -> bytearray:
        payload = self._buffer
        self._start_part(FRAME_HEADER.size, in_header=True)
        self.waited_s = 0.0
        return payload


_decoder = msgspec.msgpack.Decoder(Append)


def read_append(peer: Peer) -> Append | ErrorReply | None:
    """The request whose frame `peer` completed now, an ErrorReply for a frame that is not an Append, or
    None: no whole frame yet. Raises PeerGone."""
    payload = peer.receive()
    if payload is None:
        return None
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as error:
        return ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"the direct channel takes Append only: {error}")


class DirectChannel:
    """The worker's side: accepts same-uid connections and serves Appends of the bound session on the
    worker's one context, reporting each to the supervisor through the control words of the segment
    (busy while computing, then the length and the time, and running counts). Its listener and peers are
    registered in the worker's selector: the listener with this channel as data, each peer with itself."""

    def __init__(self, address: str, server: WorkerServer, segment, cancel_connection, selector: selectors.BaseSelector,
                 frame_deadline_s: float = FRAME_DEADLINE_S, *, keep_warm: Stamp | None = None, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        """`keep_warm`: the daemon's --keep-warm stamp, touched as each append ends (None: off); `max_frame_bytes`: the
        largest request frame a peer may send (the daemon's --max-request-bytes, as its own socket takes)."""
        self.max_frame_bytes = max_frame_bytes
        self.listener = listen(address)
        self._keep_warm = keep_warm
        self.server = server
        self.frame_deadline_s = frame_deadline_s
        self._selector = selector
        self._peers: set[Peer] = set()
        self._kept_output: np.ndarray | None = None
        buffer = segment.buf
        self._abort = ctypes.c_int32.from_buffer(buffer, ABORT_FLAG_OFFSET)
        self.cancels = DirectCancels(cancel_connection, self._abort)
        self.words = DirectWords(buffer)
        selector.register(self.listener, selectors.EVENT_READ, self)

    def ready(self, source: DirectChannel | Peer, events: int) -> None:
        """`source` (this channel, for its listener, or one of its peers) is ready for `events`."""
        if source is self:
            self._accept()
            return
        try:
            if events & selectors.EVENT_WRITE:
                source.flush()
            else:
                self._serve(source)
        except PeerGone:
            self._drop(source)
            return
        if source.writing:
            self._selector.modify(source.connection, selectors.EVENT_WRITE, source)
        elif source.closing:
            self._drop(source)
        else:
            self._selector.modify(source.connection, selectors.EVENT_READ, source)

    def waited(self, seconds: float) -> None:
        """The worker waited `seconds` for its peers: it counts against every frame passing now."""
        for peer in self._peers:
            if not peer.idle:
                peer.waited_s += seconds

    def next_wait(self) -> float | None:
        """Drop the peers whose frame missed its deadline; how long the worker may wait for the others
        before the next deadline (None: no frame is passing)."""
        wait = None
        for peer in list(self._peers):
            if peer.idle:
                continue
            left = self.frame_deadline_s - peer.waited_s
            if left <= 0:
                self._drop(peer)
            else:
                wait = left if wait is None else min(wait, left)
        return wait

    def _accept(self) -> None:
        connection = accept_same_uid(self.listener)
        if connection is not None:
            peer = Peer(connection, self.max_frame_bytes)
            self._peers.add(peer)
            self._selector.register(connection, selectors.EVENT_READ, peer)

    def _serve(self, peer: Peer) -> None:
        request = read_append(peer)
        if request is None:
            return
        if isinstance(request, ErrorReply):
            peer.closing = True
            peer.write(request)
            return
        peer.write(self._append(request))

    def _drop(self, peer: Peer) -> None:
        self._peers.discard(peer)
        self._selector.unregister(peer.connection)
        peer.connection.close()

    def _append(self, request: Append) -> Message:
        server = self.server
        context = server.context
        ids = {"request_id": request.request_id, "session_id": request.session_id, "epoch": request.epoch}
        if context is None or server.bound != (request.session_id, request.epoch):
            return ErrorReply(code=ErrorCode.CHANNEL_REVOKED, message="this worker no longer serves that session directly: ask the daemon", **ids)
        shape = server.model.shape
        try:
            rows = append_rows(request, shape, max_rows=server.spec.max_n_ctx, length=context.length)
            check_position(request.start_pos, context.length, rows.shape[0], context.n_ctx)
        except RequestFailed as failure:
            return ErrorReply(code=failure.code, message=str(failure), length=failure.length, **ids)
        output_rows = str(request.output_rows)
        out = self._output(shape.output_shape(rows.shape[0], output_rows))
        key = (request.session_id, request.epoch)
        if not self.cancels.begin(key, request.request_id):
            return ErrorReply(code=ErrorCode.CANCELLED, message="append cancelled", length=context.length, **ids)
        words = self.words
        words.busy_since.value = time.monotonic()
        words.busy.value = 1
        try:
            with server.compute:
                output = context.append_checked(request.start_pos, rows, output_rows=output_rows, out=out)
        except ShardRuntimeError as error:
            code = error.code if error.code in set(ErrorCode) else ErrorCode.INTERNAL
            return ErrorReply(code=code, message=str(error), length=error.length, **ids)
        finally:
            self.cancels.end(key, request.request_id)
            words.length.value = context.length  # before its time and before busy clears (DirectControls.activity reads them so)
            ended = time.monotonic()
            words.last_used.value = ended
            words.busy.value = 0
            if self._keep_warm is not None:
                self._keep_warm.touch(ended)  # the same moment: one clock read on the decode step
        words.appends.value += 1
        words.rows.value += rows.shape[0]
        reply = answer(output, request.sample, context.length)
        return AppendReply(  # the rows' buffer as it is: encoding the reply is their one copy (fewer calls than a byte view)
            length=context.length, rows=reply.rows.shape[0], width=output.shape[1], data=np.ascontiguousarray(reply.rows).data,
            **reply.reply_fields, **ids,
        )

    def _output(self, shape: tuple[int, int]) -> np.ndarray:
        """Where an append's rows are written: one array kept for a decode step's shape (one row; its reply
        is encoded, a copy, before the next append can write there: a last shard's logits, above glibc's
        mmap threshold in a worker, are not mapped and faulted in afresh on every step), a new one else."""
        kept = self._kept_output
        if kept is not None and kept.shape == shape:
            return kept
        out = np.empty(shape, dtype=np.float32)
        if shape[0] == 1:
            self._kept_output = out
        return out

    def close(self) -> None:
        """Drop every peer and the views of the segment (it closes next)."""
        for peer in list(self._peers):
            self._drop(peer)
        self.cancels.release()
        del self._abort
        self.words.release()
        if self._keep_warm is not None:
            self._keep_warm.release()
            self._keep_warm = None
        self._selector.unregister(self.listener)
        self.listener.close()

"""A worker's direct channel: a Unix socket (abstract namespace, same-uid peers only) on which a router's
client sends the appends of the one session the supervisor bound to this worker, without the supervisor in
between. Frames and messages are the daemon's own (kvpool.protocol); anything but an Append of the bound
session is answered channel_revoked, and the client then asks the supervisor, whose answer is the typed
error of the contract."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time
from typing import TYPE_CHECKING

import msgspec

from kvpool.append_checks import append_rows, check_position
from kvpool.errors import RequestFailed
from kvpool.protocol import FRAME_HEADER, Append, AppendReply, ErrorCode, ErrorReply, Message, encode, receive_exactly
from workers.commands import ABORT_FLAG_OFFSET
from workers.direct_cancels import DirectCancels
from workers.direct_words import DirectWords
from workers.errors import ShardRuntimeError
from workers.sampling import sample

if TYPE_CHECKING:
    from workers.process import WorkerServer

FRAME_READ_TIMEOUT_S = 30.0  # a client that stops mid-frame is dropped, never waited on forever
MAX_FRAME_BYTES = 256 * 1024 * 1024
ONE_WRITE_BYTES = 64 * 1024  # a reply this small fits an empty socket buffer: one write, never a wait


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
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    if uid != os.getuid():
        connection.close()
        return None
    # Blocking, with the kernel's own time limits rather than Python's timeout (which polls before every
    # recv and send): a client stopped mid-frame, or not reading its reply, is dropped just the same.
    connection.setblocking(True)
    limit = struct.pack("ll", int(FRAME_READ_TIMEOUT_S), 0)  # struct timeval
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    return connection


_decoder = msgspec.msgpack.Decoder(Append)


def read_append(connection: socket.socket) -> Append | ErrorReply | None:
    """The next request, an ErrorReply for a frame that is not an Append, or None: the peer is gone."""
    try:
        header = receive_exactly(connection, FRAME_HEADER.size)
        if header is None:
            return None
        (size,) = FRAME_HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            return None
        payload = receive_exactly(connection, size)
    except OSError:
        return None
    if payload is None:
        return None
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as error:
        return ErrorReply(code=ErrorCode.BAD_REQUEST, message=f"the direct channel takes Append only: {error}")


def send(connection: socket.socket, reply: Message) -> bool:
    frame = encode(reply)
    try:
        if len(frame) <= ONE_WRITE_BYTES:
            connection.sendall(frame)
        else:  # one time limit for the whole frame, not for each write (a slow reader is dropped in time)
            connection.settimeout(FRAME_READ_TIMEOUT_S)
            try:
                connection.sendall(frame)
            finally:
                connection.setblocking(True)
    except OSError:
        return False
    return True


class DirectChannel:
    """The worker's side: accepts same-uid connections and serves Appends of the bound session on the
    worker's one context, reporting each to the supervisor through the control words of the segment
    (busy while computing, then the length and the time, and running counts)."""

    def __init__(self, address: str, server: WorkerServer, segment, cancel_connection) -> None:
        self.listener = listen(address)
        self.server = server
        buffer = segment.buf
        self._abort = ctypes.c_int32.from_buffer(buffer, ABORT_FLAG_OFFSET)
        self.cancels = DirectCancels(cancel_connection, self._abort)
        self.words = DirectWords(buffer)

    def accept(self) -> socket.socket | None:
        return accept_same_uid(self.listener)

    def serve(self, connection: socket.socket) -> bool:
        """Answer one request from `connection`; False when the connection is done (closed or broken)."""
        request = read_append(connection)
        if request is None:
            return False
        if isinstance(request, ErrorReply):
            send(connection, request)
            return False
        return send(connection, self._append(request))

    def _append(self, request: Append) -> Message:
        server = self.server
        context = server.context
        ids = {"request_id": request.request_id, "session_id": request.session_id, "epoch": request.epoch}
        if context is None or server.bound != (request.session_id, request.epoch):
            return ErrorReply(code=ErrorCode.CHANNEL_REVOKED, message="this worker no longer serves that session directly: ask the daemon", **ids)
        layout = server.model.layout
        try:
            rows = append_rows(request, layout, max_rows=server.spec.max_n_ctx, length=context.length)
            check_position(request.start_pos, context.length, rows.shape[0], context.n_ctx)
        except RequestFailed as failure:
            return ErrorReply(code=failure.code, message=str(failure), length=failure.length, **ids)
        inputs = {"tokens": rows} if layout.is_first else {"hidden": rows}
        key = (request.session_id, request.epoch)
        if not self.cancels.begin(key, request.request_id):
            return ErrorReply(code=ErrorCode.CANCELLED, message="append cancelled", length=context.length, **ids)
        words = self.words
        words.busy_since.value = time.monotonic()
        words.busy.value = 1
        try:
            with server.compute:
                output = context.append(request.start_pos, output_rows=str(request.output_rows), **inputs)
        except ShardRuntimeError as error:
            code = error.code if error.code in set(ErrorCode) else ErrorCode.INTERNAL
            return ErrorReply(code=code, message=str(error), length=error.length, **ids)
        finally:
            self.cancels.end(key, request.request_id)
            words.busy.value = 0
            words.length.value = context.length
            words.last_used.value = time.monotonic()
        words.appends.value += 1
        words.rows.value += rows.shape[0]
        common = {"length": context.length, "width": output.shape[1], **ids}
        if request.sample is None:
            return AppendReply(rows=output.shape[0], data=output.tobytes(), **common)
        picked = sample(output[-1], request.sample, context.length)
        return AppendReply(
            rows=output.shape[0] if request.sample.logits else 0, data=output.tobytes() if request.sample.logits else b"",
            token=picked.token, top_ids=picked.top_ids, top_logprobs=picked.top_logprobs, **common,
        )

    def close(self) -> None:
        del self._abort
        self.words.release()
        self.listener.close()

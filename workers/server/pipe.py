"""The supervisor-worker pipe as both ends speak it: one msgpack message per command and per reply, and a
saved state's bytes (SaveState's reply, RestoreState's blob) beside its message in a memfd whose descriptor
crosses the pipe (a Unix socket pair) as SCM_RIGHTS ancillary data.

Why not in the message: a state is megabytes (3.76 MiB for 512 positions of the middle bundled shard), and
through the socket pair it moved in 64 KiB pieces, each a wake-up of the other process, into buffers grown
as it came: measured in a worker, encoding a Saved reply took 1.6-16 ms and sending it 3-15 ms, receiving a
RestoreState 7-18 ms, all for one 3.76 MiB blob. A memfd is written with one write() and read with one
read() (or mapped: a worker hands llama.cpp the mapping itself, workers.runtime.sequence_io), takes no room
in /dev/shm (its pages are the writer's memory until both ends close it), and is gone once both have.

The order on the pipe: the message (its blob empty, blob_bytes its size), then one byte carrying the
descriptor. The writer fills the memfd before it sends the message, so the reader never waits between them.

A park's save asks for room around the bytes (SaveState.head / .tail): the worker leaves that many bytes
before and after them in its memfd, and the supervisor keeps the memfd itself as the stored state
(kvpool.state.shared.SharedState: it writes the header and CRC in and seals it), with no copy. A restore
of such a state sends that descriptor back (RestoreState.blob_offset: where llama.cpp's bytes begin in it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection

import msgspec

from kvpool.state.shared import SharedPayload, SharedState, new_memfd
from workers.server.commands import AnyCommand, AnyWorkerReply, RestoreState, Saved


class WrittenState:
    """A saved state already in a memfd, laid out as its Saved reply's room says (the worker's park:
    workers.runtime.sequence_io.save_sequence_to_memfd); send_reply sends `fd` as it is and closes it."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


class StateTransferError(OSError):
    """A state's bytes did not cross the pipe whole (no descriptor, or fewer bytes than announced)."""


def _memfd_of(data: bytes | memoryview, head: int = 0, tail: int = 0) -> int:
    """A memfd holding `data` after `head` bytes, `tail` bytes after it (those zeros)."""
    fd = new_memfd()
    try:
        view = memoryview(data).cast("B")
        if head or tail:
            os.ftruncate(fd, head + len(view) + tail)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], head + written)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _send_descriptor(connection: Connection, fd: int) -> None:
    with socket.socket(fileno=os.dup(connection.fileno())) as sock:
        socket.send_fds(sock, [b"S"], [fd])


def _receive_descriptor(connection: Connection) -> int:
    with socket.socket(fileno=os.dup(connection.fileno())) as sock:
        message, fds, _flags, _address = socket.recv_fds(sock, 1, 1)
    if message != b"S" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise StateTransferError("a state's descriptor did not follow its message")
    return fds[0]


def _send(connection: Connection, encoder: msgspec.msgpack.Encoder, message, fd: int, **fields) -> None:
    """`message` with `fields` in place of its blob, then `fd` (closed here)."""
    try:
        connection.send_bytes(encoder.encode(msgspec.structs.replace(message, blob=b"", **fields)))
        _send_descriptor(connection, fd)
    finally:
        os.close(fd)


def send_command(connection: Connection, encoder: msgspec.msgpack.Encoder, command: AnyCommand) -> None:
    """The supervisor's end: `command`, and a RestoreState's blob beside it (a SharedPayload's own
    descriptor, else a memfd of the bytes)."""
    if not isinstance(command, RestoreState):
        connection.send_bytes(encoder.encode(command))
    elif isinstance(command.blob, SharedPayload):
        _send(connection, encoder, command, os.dup(command.blob.state.fd), blob_bytes=len(command.blob), blob_offset=command.blob.offset)
    else:
        _send(connection, encoder, command, _memfd_of(command.blob), blob_bytes=len(command.blob), blob_offset=0)


def send_reply(connection: Connection, encoder: msgspec.msgpack.Encoder, reply: AnyWorkerReply) -> None:
    """A worker's end: `reply`, and a Saved reply's blob beside it (with the room it asks for around it)."""
    if not isinstance(reply, Saved):
        connection.send_bytes(encoder.encode(reply))
        return
    fd = reply.blob.fd if isinstance(reply.blob, WrittenState) else _memfd_of(reply.blob, reply.head, reply.tail)
    _send(connection, encoder, reply, fd, blob_bytes=len(reply.blob))


def receive_reply(connection: Connection, decoder: msgspec.msgpack.Decoder) -> AnyWorkerReply:
    """The supervisor's end: the next reply, a Saved one with its blob: a SharedState of the worker's
    memfd when it has room around the bytes (Saved.head / .tail) and this process may keep one more open,
    else the bytes read in. Raises EOFError or OSError (StateTransferError among them) as the pipe does."""
    reply = decoder.decode(connection.recv_bytes())
    if not isinstance(reply, Saved):
        return reply
    fd = _receive_descriptor(connection)
    if (reply.head or reply.tail) and SharedState.available():
        try:
            shared = SharedState.adopt(fd, head=reply.head, payload_bytes=reply.blob_bytes, tail=reply.tail)
        except ValueError as error:
            raise StateTransferError(str(error)) from None
        if shared is not None:
            return msgspec.structs.replace(reply, blob=shared, blob_bytes=0)
    try:
        blob = os.pread(fd, reply.blob_bytes, reply.head) if reply.blob_bytes else b""
    finally:
        os.close(fd)
    if len(blob) != reply.blob_bytes:
        raise StateTransferError(f"a saved state of {reply.blob_bytes} bytes arrived with {len(blob)}")
    return msgspec.structs.replace(reply, blob=blob, blob_bytes=0, head=0, tail=0)


@contextlib.contextmanager
def received_command(connection: Connection, decoder: msgspec.msgpack.Decoder) -> Iterator[AnyCommand]:
    """A worker's end: the next command; a RestoreState's blob is a read-only view of the memfd's mapping,
    valid inside the block (unmapped after it). Raises EOFError or OSError as the pipe does."""
    command = decoder.decode(connection.recv_bytes())
    if not isinstance(command, RestoreState):
        yield command
        return
    fd = _receive_descriptor(connection)
    try:
        size = os.fstat(fd).st_size
        if command.blob_offset < 0 or size < command.blob_offset + command.blob_bytes:
            raise StateTransferError(f"a state of {command.blob_bytes} bytes at {command.blob_offset} arrived in {size}")
        # private: a shared mapping of a write-sealed memfd is refused before Linux 6.7 (a read-only private one copies nothing)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ) if command.blob_bytes else None
    finally:
        os.close(fd)
    if mapping is None:
        yield msgspec.structs.replace(command, blob=memoryview(b""), blob_bytes=0, blob_offset=0)
        return
    view = memoryview(mapping)
    blob = view[command.blob_offset : command.blob_offset + command.blob_bytes]
    try:
        yield msgspec.structs.replace(command, blob=blob, blob_bytes=0, blob_offset=0)
    finally:
        with contextlib.suppress(BufferError):  # a view still exported: unmapped when the last one goes
            blob.release()
            view.release()
            mapping.close()

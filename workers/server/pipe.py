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

from kvpool.state.shared import SharedPayload, SharedState, memfd_of
from workers.server.commands import AnyCommand, AnyWorkerReply, RestoreState, RunAppend, Saved


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


def _send(connection: Connection, encoder: msgspec.msgpack.Encoder, message, fd: int) -> None:
    """`message` (its blob's place emptied by the caller), then `fd` (closed here)."""
    try:
        connection.send_bytes(encoder.encode(message))
        _send_descriptor(connection, fd)
    finally:
        os.close(fd)


def _restore_of(command: AnyCommand) -> RestoreState | None:
    """The restore a command carries a blob for: a RestoreState's own, or the one a RunAppend travels with."""
    if isinstance(command, RunAppend):
        return command.restore
    return command if isinstance(command, RestoreState) else None


class StateDescriptor:
    """A state to restore, made ready to travel (prepared_state): a descriptor of its own (closed by the
    send, or by `close`) and where in it the bytes lie. A RestoreState's blob may be one."""

    def __init__(self, fd: int, nbytes: int, offset: int) -> None:
        self.fd, self.nbytes, self.offset = fd, nbytes, offset

    def __len__(self) -> int:
        return self.nbytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    __del__ = close  # one never sent nor closed (its worker lost first) is not left open


def prepared_state(blob: bytes | memoryview | SharedPayload | StateDescriptor) -> StateDescriptor:
    """What travels beside a RestoreState: a SharedPayload's own memfd (a descriptor of it), else a new
    memfd of the bytes; the caller may close or reuse `blob` at once."""
    if isinstance(blob, StateDescriptor):
        return blob
    if isinstance(blob, SharedPayload):
        return StateDescriptor(os.dup(blob.state.fd), len(blob), blob.offset)
    return StateDescriptor(memfd_of([blob]), len(memoryview(blob).cast("B")), 0)


def send_command(connection: Connection, encoder: msgspec.msgpack.Encoder, command: AnyCommand) -> None:
    """The supervisor's end: `command`, and the blob of a RestoreState (or of the one a RunAppend carries)
    beside it (prepared_state)."""
    restore = _restore_of(command)
    if restore is None:
        connection.send_bytes(encoder.encode(command))
        return
    state = prepared_state(restore.blob)  # a StateDescriptor handed in is consumed here too
    on_wire = msgspec.structs.replace(restore, blob=b"", blob_bytes=state.nbytes, blob_offset=state.offset)
    message = msgspec.structs.replace(command, restore=on_wire) if isinstance(command, RunAppend) else on_wire
    fd, state.fd = state.fd, -1  # from here _send closes it (before, the descriptor's own close would)
    _send(connection, encoder, message, fd)


def send_reply(connection: Connection, encoder: msgspec.msgpack.Encoder, reply: AnyWorkerReply) -> None:
    """A worker's end: `reply`, and a Saved reply's blob beside it (with the room it asks for around it)."""
    if not isinstance(reply, Saved):
        connection.send_bytes(encoder.encode(reply))
        return
    fd = reply.blob.fd if isinstance(reply.blob, WrittenState) else memfd_of([reply.blob], reply.head, reply.tail)
    _send(connection, encoder, msgspec.structs.replace(reply, blob=b"", blob_bytes=len(reply.blob)), fd)


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
    """A worker's end: the next command; a RestoreState's blob (or that of the one a RunAppend carries) is a
    read-only view of the memfd's mapping, valid inside the block (unmapped after it). The mapping is not
    populated: a restore that resumes its own park's cells reads none of it. Raises EOFError or OSError as
    the pipe does."""
    command = decoder.decode(connection.recv_bytes())
    restore = _restore_of(command)
    if restore is None:
        yield command
        return

    def carrying(blob: memoryview) -> AnyCommand:
        received = msgspec.structs.replace(restore, blob=blob, blob_bytes=0, blob_offset=0)
        return msgspec.structs.replace(command, restore=received) if isinstance(command, RunAppend) else received

    fd = _receive_descriptor(connection)
    try:
        size = os.fstat(fd).st_size
        if restore.blob_offset < 0 or size < restore.blob_offset + restore.blob_bytes:
            raise StateTransferError(f"a state of {restore.blob_bytes} bytes at {restore.blob_offset} arrived in {size}")
        # private: a shared mapping of a write-sealed memfd is refused before Linux 6.7 (a read-only private one copies nothing)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) if restore.blob_bytes else None
    finally:
        os.close(fd)
    if mapping is None:
        yield carrying(memoryview(b""))
        return
    view = memoryview(mapping)
    blob = view[restore.blob_offset : restore.blob_offset + restore.blob_bytes]
    try:
        yield carrying(blob)
    finally:
        with contextlib.suppress(BufferError):  # a view still exported: unmapped when the last one goes
            blob.release()
            view.release()
            mapping.close()

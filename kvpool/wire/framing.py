"""The framing rule of every kvpool socket (a daemon's, a worker's direct channel): a frame is a 4-byte
big-endian payload size, then that many bytes of payload.

Every reader checks the size a header announces against its own limit before it reads (or holds room for)
the payload: `frame_size` is that check, `FrameTooLarge` its error, and `FrameTruncated` the error for a
peer that closed inside a frame. A peer that closes between two frames breaks no rule: readers return None.
The readers here are the blocking and the asyncio ones; a reader with other needs (deadlines, a byte
allowance, non-blocking reads) keeps its own loop around `frame_size`.
"""

from __future__ import annotations

import contextlib
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the workers import the wire and never asyncio
    import asyncio

FRAME_HEADER = struct.Struct(">I")
REUSED_PAYLOAD_BYTES = 4 * 1024 * 1024  # the largest frame buffer kept for the next frame (receive_frame's reuse, a direct channel's replies); larger ones get their own


class FrameError(Exception):
    """A frame that breaks the framing rule: nothing more can be read from that connection."""


class FrameTooLarge(FrameError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit}")
        self.size = size
        self.limit = limit


class FrameTruncated(FrameError):
    def __init__(self, part: str, received: int, expected: int) -> None:
        super().__init__(f"the peer closed the connection after {received} of the {expected} bytes of a frame's {part}")
        self.part = part  # "header" or "payload"
        self.received = received
        self.expected = expected


def framed(payload: bytes) -> bytes:
    """One whole frame: header plus payload."""
    return FRAME_HEADER.pack(len(payload)) + payload


def frame_in_place(buffer: bytearray) -> bytearray:
    """`buffer`, whose payload was written after FRAME_HEADER.size bytes left for the header, made one whole frame."""
    FRAME_HEADER.pack_into(buffer, 0, len(buffer) - FRAME_HEADER.size)
    return buffer


def frame_size(header: bytes | bytearray | memoryview, limit: int) -> int:
    """The payload size the header at the start of `header` announces, at most `limit` (else FrameTooLarge)."""
    (size,) = FRAME_HEADER.unpack_from(header)
    if size > limit:
        raise FrameTooLarge(size, limit)
    return size


def receive_exactly(sock, size: int) -> bytes | None:
    """`size` bytes from a blocking socket, or None when the peer closed it first."""
    buffer = bytearray(size)
    received = _receive_into(sock, buffer)
    return bytes(buffer) if received == size else None


def receive_frame(sock, limit: int, reuse: bytearray | None = None) -> bytearray | memoryview | None:
    """The payload of the next frame on a blocking socket (at most `limit` bytes), or None when the peer
    closed it before the frame began. Raises FrameTooLarge, FrameTruncated.

    With `reuse`, a payload of at most REUSED_PAYLOAD_BYTES is read into it (grown as needed, never shrunk) and a
    view of it returned, valid until the next call with the same buffer (which overwrites it; where it must grow
    while a view is held, the payload gets a buffer of its own): a client reading a large reply every step (a last
    shard's logits) writes into pages it already has instead of a new allocation the kernel faults in."""
    header = bytearray(FRAME_HEADER.size)
    received = _receive_into(sock, header)
    if received == 0:
        return None
    if received < len(header):
        raise FrameTruncated("header", received, len(header))
    size = frame_size(header, limit)
    payload: bytearray | memoryview | None = None
    if reuse is not None and size <= REUSED_PAYLOAD_BYTES:
        with contextlib.suppress(BufferError):  # it must grow while a view of it is held: this payload gets its own buffer
            if len(reuse) < size:
                reuse.extend(bytes(size - len(reuse)))
            payload = memoryview(reuse)[:size]
    if payload is None:
        payload = bytearray(size)
    received = _receive_into(sock, payload)
    if received < size:
        raise FrameTruncated("payload", received, size)
    return payload


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """`receive_frame` on an asyncio stream."""
    try:
        header = await reader.readexactly(FRAME_HEADER.size)
    except EOFError as error:  # asyncio.IncompleteReadError: `partial` holds what did arrive
        if not error.partial:
            return None
        raise FrameTruncated("header", len(error.partial), FRAME_HEADER.size) from None
    size = frame_size(header, limit)
    try:
        return await reader.readexactly(size)
    except EOFError as error:
        raise FrameTruncated("payload", len(error.partial), size) from None


def _receive_into(sock, buffer: bytearray | memoryview) -> int:
    """Fill `buffer` from a blocking socket; the bytes received (fewer only when the peer closed it)."""
    view = memoryview(buffer)
    received = 0
    while received < len(buffer):
        count = sock.recv_into(view[received:])
        if count == 0:
            break
        received += count
    return received

"""The wire's framing rule and peer check (kvpool.wire.framing, kvpool.wire.peers), which the daemon, both
clients and a worker's direct channel share: the size limit at its edge, a frame cut short, a clean close."""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np
import pytest

from kvpool.wire import framing
from kvpool.wire.framing import FRAME_HEADER, FrameTooLarge, FrameTruncated, frame_in_place, frame_size, framed, read_frame, receive_frame
from kvpool.wire.peers import peer_credentials, same_user
from kvpool.wire.protocol import AppendReply, decode_reply, encode, encode_into

LIMIT = 16


def test_a_header_announcing_the_limit_passes_and_one_byte_more_is_refused():
    assert frame_size(FRAME_HEADER.pack(LIMIT), LIMIT) == LIMIT
    with pytest.raises(FrameTooLarge) as refused:
        frame_size(FRAME_HEADER.pack(LIMIT + 1), LIMIT)
    assert (refused.value.size, refused.value.limit) == (LIMIT + 1, LIMIT)
    assert str(refused.value) == f"frame of {LIMIT + 1} bytes exceeds the limit of {LIMIT}"


def test_the_header_is_four_bytes_big_endian():
    assert framed(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame_size(b"\x00\x00\x01\x00 and more", 2**32 - 1) == 256  # the header is read from the start


def _pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def test_blocking_reads_frames_up_to_the_limit_then_none_at_a_clean_close():
    sender, receiver = _pair()
    with sender, receiver:
        sender.sendall(framed(b"x" * LIMIT) + framed(b""))
        sender.close()
        assert receive_frame(receiver, LIMIT) == b"x" * LIMIT
        assert receive_frame(receiver, LIMIT) == b""
        assert receive_frame(receiver, LIMIT) is None


def test_blocking_refuses_a_frame_over_the_limit_before_reading_its_payload():
    sender, receiver = _pair()
    with sender, receiver:
        sender.sendall(FRAME_HEADER.pack(LIMIT + 1))  # no payload follows: a read of it would hang
        with pytest.raises(FrameTooLarge):
            receive_frame(receiver, LIMIT)


@pytest.mark.parametrize(("sent", "part", "received", "expected"), [(b"\x00\x00", "header", 2, 4), (framed(b"abcd")[:6], "payload", 2, 4)])
def test_blocking_a_frame_cut_short_is_truncated(sent, part, received, expected):
    sender, receiver = _pair()
    with sender, receiver:
        sender.sendall(sent)
        sender.close()
        with pytest.raises(FrameTruncated) as cut:
            receive_frame(receiver, LIMIT)
        assert (cut.value.part, cut.value.received, cut.value.expected) == (part, received, expected)


def test_a_reused_buffer_takes_each_payload_in_turn_and_grows_only_as_needed(monkeypatch):
    monkeypatch.setattr(framing, "REUSED_PAYLOAD_BYTES", 8)
    reuse = bytearray()
    sender, receiver = _pair()
    with sender, receiver:
        sender.sendall(framed(b"abcdef") + framed(b"xy") + framed(b"12345678") + framed(b"123456789") + framed(b"zz"))
        first = receive_frame(receiver, LIMIT, reuse)
        assert isinstance(first, memoryview) and first.obj is reuse and bytes(first) == b"abcdef" and len(reuse) == 6
        del first
        second = receive_frame(receiver, LIMIT, reuse)
        assert second.obj is reuse and bytes(second) == b"xy" and reuse == b"xycdef"  # the same pages, not shrunk
        del second
        at_the_bound = receive_frame(receiver, LIMIT, reuse)
        assert at_the_bound.obj is reuse and bytes(at_the_bound) == b"12345678" and len(reuse) == 8
        del at_the_bound
        over = receive_frame(receiver, LIMIT, reuse)  # one byte over the bound: a buffer of its own
        assert isinstance(over, bytearray) and over == b"123456789" and reuse == b"12345678"
        held = receive_frame(receiver, LIMIT, reuse)
        assert held.obj is reuse and bytes(held) == b"zz"


def test_a_reused_buffer_that_must_grow_while_viewed_is_left_alone_and_the_payload_gets_its_own():
    reuse = bytearray()
    sender, receiver = _pair()
    with sender, receiver:
        sender.sendall(framed(b"ab") + framed(b"cdef"))
        kept = receive_frame(receiver, LIMIT, reuse)  # a caller still holding the last payload's view
        second = receive_frame(receiver, LIMIT, reuse)  # it must grow, which the view forbids
        assert isinstance(second, bytearray) and second == b"cdef"
        assert bytes(kept) == b"ab" and reuse == b"ab"


def test_a_frame_made_in_place_is_the_framed_payload():
    buffer = bytearray(FRAME_HEADER.size) + b"payload"
    assert frame_in_place(buffer) is buffer and bytes(buffer) == framed(b"payload")


def test_a_message_encoded_into_a_buffer_is_the_frame_encode_makes_and_reuses_the_buffer():
    rows = np.arange(12, dtype=np.float32).reshape(2, 6)
    as_bytes = AppendReply(request_id=7, session_id="s", epoch=1, length=2, rows=2, width=6, data=rows.tobytes())
    as_view = AppendReply(request_id=7, session_id="s", epoch=1, length=2, rows=2, width=6, data=memoryview(rows.reshape(-1).view(np.uint8)))
    buffer = bytearray(b"left over from a longer frame" * 10)
    assert encode_into(as_view, buffer) is buffer and bytes(buffer) == encode(as_bytes)
    assert decode_reply(memoryview(buffer)[FRAME_HEADER.size :]) == as_bytes
    longer = AppendReply(request_id=7, session_id="s" * 100, epoch=1, length=2, rows=2, width=6, data=rows.tobytes())
    assert encode_into(longer, buffer) is buffer and bytes(buffer) == encode(longer)  # grown in place


def test_a_client_connection_reads_replies_into_one_buffer_and_lets_it_go_when_closed(tmp_path):
    from kvpool.client.connection import ClientConnection

    path = str(tmp_path / "s")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        connection = ClientConnection(path, 5.0, "test", handshake=False)
        daemon, _ = listener.accept()
        with daemon:
            rows = np.arange(1000, dtype=np.float32)
            replies = [AppendReply(request_id=index, session_id="s", epoch=1, length=1, rows=1, width=1000, data=(rows + index).tobytes())
                       for index in (1, 2)]
            daemon.sendall(encode(replies[0]) + encode(replies[1]))
            first = connection.receive(1)
            buffer = connection._received
            second = connection.receive(2)
            assert connection._received is buffer and len(buffer) >= 4000  # both read into it
            assert (first, second) == tuple(replies)  # the first reply's rows are its own, not the buffer's
            connection.close()
            assert len(connection._received) == 0


def _stream(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_asyncio_reads_the_same_frames_and_raises_the_same_errors():
    async def scenario():
        reader = _stream(framed(b"x" * LIMIT) + framed(b"ab"))
        assert await read_frame(reader, LIMIT) == b"x" * LIMIT
        assert await read_frame(reader, LIMIT) == b"ab"
        assert await read_frame(reader, LIMIT) is None
        with pytest.raises(FrameTooLarge):
            await read_frame(_stream(FRAME_HEADER.pack(LIMIT + 1)), LIMIT)
        with pytest.raises(FrameTruncated) as header:
            await read_frame(_stream(b"\x00"), LIMIT)
        with pytest.raises(FrameTruncated) as payload:
            await read_frame(_stream(framed(b"abcd")[:5]), LIMIT)
        return header.value, payload.value

    header, payload = asyncio.run(scenario())
    assert (header.part, header.received, payload.part, payload.received, payload.expected) == ("header", 1, "payload", 1, 4)


def test_a_peer_of_this_user_is_allowed():
    left, right = _pair()
    with left, right:
        pid, uid, _gid = peer_credentials(left)
        assert (pid, uid) == (os.getpid(), os.getuid())
        assert same_user(left)


def _connect_as_nobody(address: str) -> int:
    """A child process, as uid 65534, connected to the abstract socket `address` until the parent closes
    it (or a hang guard passes); its pid."""
    child = os.fork()
    if child == 0:  # pragma: no cover - child process
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(60.0)
                sock.connect("\0" + address)
                sock.recv(1)
        finally:
            os._exit(0)
    return child


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_a_peer_of_another_user_is_refused_by_the_wire_and_by_a_workers_direct_channel():
    from workers.server.direct import accept_same_uid

    address = f"kvpool-test-peers-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    children = []
    try:
        listener.bind("\0" + address)
        listener.listen(2)
        listener.settimeout(30.0)  # a hang guard (the channel's own listener is non-blocking, polled when ready)
        children = [_connect_as_nobody(address), _connect_as_nobody(address)]
        with listener.accept()[0] as connection:
            credentials = peer_credentials(connection)
            refused_by_the_wire = not same_user(connection)
        accepted = accept_same_uid(listener)
        if accepted is not None:
            accepted.close()
    finally:
        listener.close()
        for child in children:
            os.waitpid(child, 0)
    assert credentials[1] == 65534
    assert refused_by_the_wire
    assert accepted is None  # the direct channel accepted, then closed it

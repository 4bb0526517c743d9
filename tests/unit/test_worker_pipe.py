"""The supervisor-worker pipe (workers.server.pipe): a state's bytes cross beside their message in a memfd,
whole, in both directions, and nothing is left open behind them."""

from __future__ import annotations

import os
import socket

import msgspec
import pytest

from tests.support.pipes import open_descriptors
from workers.server.commands import AnyCommand, AnyWorkerReply, Closed, RestoreState, RunAppend, Saved, SaveState
from workers.server.pipe import StateTransferError, prepared_state, receive_reply, received_command, send_command, send_reply

BLOB = bytes(range(256)) * 4099 + b"tail"  # ~1 MiB, not a multiple of a page


def test_a_restore_blob_reaches_the_worker_as_a_view_and_is_unmapped_after(pipe) -> None:
    supervisor, worker = pipe
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(AnyCommand)
    before = open_descriptors()
    send_command(supervisor, encoder, RestoreState(n_ctx=64, length=5, blob=BLOB, seq=1))
    with received_command(worker, decoder) as command:
        assert isinstance(command, RestoreState) and (command.n_ctx, command.length, command.seq, command.blob_bytes) == (64, 5, 1, 0)
        assert isinstance(command.blob, memoryview) and command.blob.readonly and command.blob == BLOB
        blob = command.blob
    with pytest.raises(ValueError):  # released with the block: the mapping is gone
        bytes(blob)
    assert open_descriptors() - before == set()


def test_a_restore_carried_by_an_append_crosses_as_one_alone_does_and_a_prepared_one_is_consumed(pipe) -> None:
    supervisor, worker = pipe
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(AnyCommand)
    before = open_descriptors()
    prepared = prepared_state(BLOB)  # made ready ahead (WorkerHandle.restore_with_append): the bytes may go at once
    assert len(prepared) == len(BLOB) and str(prepared.fd) in {fd for fd, _ in open_descriptors() - before}
    send_command(supervisor, encoder, RunAppend(start_pos=5, n_rows=1, restore=RestoreState(n_ctx=64, length=5, blob=prepared, owner=3)))
    assert prepared.fd == -1  # the send closed its descriptor
    with received_command(worker, decoder) as command:
        assert isinstance(command, RunAppend) and (command.start_pos, command.n_rows) == (5, 1)
        restore = command.restore
        assert (restore.n_ctx, restore.length, restore.owner, restore.blob_bytes) == (64, 5, 3, 0) and restore.blob == BLOB
        blob = restore.blob
    with pytest.raises(ValueError):  # released with the block, as a RestoreState's
        bytes(blob)
    send_command(supervisor, encoder, RunAppend(start_pos=0, n_rows=2))  # without one: the message alone
    with received_command(worker, decoder) as command:
        assert command == RunAppend(start_pos=0, n_rows=2)
    unsent = prepared_state(memoryview(BLOB)[:10])
    unsent.close()
    unsent.close()  # closing twice is harmless
    assert open_descriptors() - before == set()


def test_a_saved_state_reaches_the_supervisor_as_bytes_of_its_own(pipe) -> None:
    supervisor, worker = pipe
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(AnyWorkerReply)
    before = open_descriptors()
    send_reply(worker, encoder, Saved(length=7, blob=BLOB))
    reply = receive_reply(supervisor, decoder)
    assert reply == Saved(length=7, blob=BLOB) and type(reply.blob) is bytes
    assert open_descriptors() - before == set()


def test_other_messages_and_an_empty_blob_cross_as_before(pipe) -> None:
    supervisor, worker = pipe
    send_command(supervisor, msgspec.msgpack.Encoder(), SaveState(seq=2))
    with received_command(worker, msgspec.msgpack.Decoder(AnyCommand)) as command:
        assert command == SaveState(seq=2)
    send_reply(worker, msgspec.msgpack.Encoder(), Closed())
    assert receive_reply(supervisor, msgspec.msgpack.Decoder(AnyWorkerReply)) == Closed()
    send_reply(worker, msgspec.msgpack.Encoder(), Saved(length=0, blob=b""))
    assert receive_reply(supervisor, msgspec.msgpack.Decoder(AnyWorkerReply)) == Saved(length=0, blob=b"")
    send_command(supervisor, msgspec.msgpack.Encoder(), RestoreState(n_ctx=8, length=0, blob=b""))
    with received_command(worker, msgspec.msgpack.Decoder(AnyCommand)) as command:
        assert bytes(command.blob) == b""


def test_a_state_message_without_its_descriptor_is_refused(pipe) -> None:
    """A Saved reply that announces bytes but arrives without the descriptor: a typed error, not a hang or a
    short state (the next byte on the pipe is not the descriptor's)."""
    supervisor, worker = pipe
    encoder = msgspec.msgpack.Encoder()
    worker.send_bytes(encoder.encode(Saved(length=1, blob_bytes=10)))
    worker.send_bytes(encoder.encode(Closed()))
    with pytest.raises(StateTransferError):
        receive_reply(supervisor, msgspec.msgpack.Decoder(AnyWorkerReply))


def test_a_blob_of_another_size_than_announced_is_refused(pipe) -> None:
    supervisor, worker = pipe
    supervisor.send_bytes(msgspec.msgpack.Encoder().encode(RestoreState(n_ctx=8, length=1, blob_bytes=4)))
    fd = os.memfd_create("test")
    os.write(fd, b"abc")
    with socket.socket(fileno=os.dup(supervisor.fileno())) as sock:
        socket.send_fds(sock, [b"S"], [fd])
    os.close(fd)
    before = open_descriptors()
    with pytest.raises(StateTransferError, match="a state of 4 bytes at 0 arrived in 3"):
        with received_command(worker, msgspec.msgpack.Decoder(AnyCommand)):
            pass
    assert open_descriptors() - before == set()

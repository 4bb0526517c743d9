"""A parked state kept in the memfd its worker wrote (kvpool.state.shared): the pipe hands it over with room
for the header and CRC, the supervisor seals it in place (the same bytes seal() gives), nothing can change it
after, a restore sends the same descriptor back, the store frees it when it leaves memory, and past the
descriptor limit the bytes are copied as before."""

from __future__ import annotations

import gc
import os
import resource
import socket

import msgspec
import pytest

from kvpool.daemon.books.sealing import StateSeal
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.books.spill import SpillStore
from kvpool.daemon.transport.listener import derived_max_connections
from kvpool.state.header import UNBOUND, StateRejected, open_state_view, seal
from kvpool.state.shared import SharedPayload, SharedState
from tests.support.pipes import open_descriptors
from workers.server.commands import AnyCommand, AnyWorkerReply, RestoreState, Saved
from workers.server.pipe import receive_reply, received_command, send_command, send_reply

PAYLOAD = bytes(range(256)) * 1031 + b"odd"  # > 64 KiB: a park's room fits its header


def _session(length: int = 9) -> Session:
    return Session(session_id="s", epoch=3, n_ctx=64, charged_bytes=0, worker_name="", length=length, last_used=0.0)


def _saved(pipe, sealing: StateSeal, session: Session, payload: bytes = PAYLOAD):
    supervisor, worker = pipe
    head, tail = sealing.room(session)
    send_reply(worker, msgspec.msgpack.Encoder(), Saved(length=session.length, blob=payload, head=head, tail=tail))
    return receive_reply(supervisor, msgspec.msgpack.Decoder(AnyWorkerReply)).blob


def test_a_park_with_room_arrives_as_shared_memory_sealed_in_place_as_seal_would(pipe) -> None:
    sealing, session = StateSeal(UNBOUND), _session()
    before = open_descriptors()
    shared = _saved(pipe, sealing, session)
    assert isinstance(shared, SharedState) and bytes(shared.payload) == PAYLOAD and not shared.sealed
    assert sealing.seal(session, shared) is shared and shared.sealed
    header, payload = open_state_view(bytes(shared.view), UNBOUND)  # a copy opens as bytes: the CRC checked
    assert bytes(payload) == PAYLOAD and header.session_id == "s" and header.length == 9
    assert bytes(shared.view) == seal(header, PAYLOAD)
    with pytest.raises(PermissionError):  # sealed: not even its owner can change a byte
        os.pwrite(shared.fd, b"x", 0)
    shared.close()
    assert shared.closed and open_descriptors() - before == set()


def test_an_unsealed_shared_state_never_opens() -> None:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.write(fd, seal(StateSeal(UNBOUND)._header(_session(), len(PAYLOAD)), PAYLOAD))
    shared = SharedState(fd, head=0, payload_bytes=os.fstat(fd).st_size, tail=0)
    with pytest.raises(StateRejected, match="not sealed"):
        open_state_view(shared, UNBOUND)
    shared.close()


def test_a_restore_sends_the_same_memory_back_and_the_worker_sees_the_payload(pipe) -> None:
    supervisor, worker = pipe
    sealing, session = StateSeal(UNBOUND), _session()
    shared = sealing.seal(session, _saved(pipe, sealing, session))
    blob = sealing.open_view(session, shared)
    assert isinstance(blob, SharedPayload) and blob.state is shared and len(blob) == len(PAYLOAD)
    before = open_descriptors()
    send_command(supervisor, msgspec.msgpack.Encoder(), RestoreState(n_ctx=64, length=9, blob=blob))
    with received_command(worker, msgspec.msgpack.Decoder(AnyCommand)) as command:
        assert command.blob.readonly and bytes(command.blob) == PAYLOAD
    assert open_descriptors() - before == set()  # the worker's mapping and descriptor are gone again
    assert not shared.closed  # the supervisor's stays until the restore is done with it
    blob.close()


def test_a_room_too_small_for_the_header_seals_a_copy_and_frees_the_memory(pipe) -> None:
    sealing, session = StateSeal(UNBOUND), _session()
    small = b"tiny"  # a payload under 64 KiB takes a narrower size field than the room was made for
    shared = _saved(pipe, sealing, session, small)
    sealed = sealing.seal(session, shared)
    assert type(sealed) is bytes and shared.closed
    assert bytes(sealing.open_view(session, sealed)) == small


def test_past_the_descriptor_limit_a_saved_state_arrives_as_bytes(pipe, monkeypatch) -> None:
    sealing, session = StateSeal(UNBOUND), _session()
    gc.collect()  # an earlier test's garbage freed now, not between the count and the saves below
    kept = [_saved(pipe, sealing, session)]
    monkeypatch.setattr(SharedState, "limit", SharedState.open_count())  # at the edge: no further one
    copied = _saved(pipe, sealing, session)
    assert type(copied) is bytes and copied == PAYLOAD
    monkeypatch.setattr(SharedState, "limit", SharedState.open_count() + 1)  # one below it: shared again
    kept.append(_saved(pipe, sealing, session))
    assert isinstance(kept[-1], SharedState)
    for shared in kept:
        shared.close()


def test_the_store_frees_shared_memory_as_it_leaves_memory(pipe, tmp_path) -> None:
    sealing = StateSeal(UNBOUND)
    sessions = [Session(session_id=f"s{i}", epoch=1, n_ctx=64, charged_bytes=0, worker_name="", length=9, last_used=0.0) for i in range(3)]
    states = [sealing.seal(session, _saved(pipe, sealing, session)) for session in sessions]
    size = len(states[0])
    store = SpillStore(2 * size, disk_dir=tmp_path / "spill", disk_limit_bytes=size)
    assert store.put(sessions[0].key, states[0]) == [] and store.put(sessions[1].key, states[1]) == []
    assert store.put(sessions[2].key, states[2]) == []  # the oldest went to disk: its memory freed, its file the same bytes
    assert states[0].closed and not states[1].closed and store.tier_of(sessions[0].key) == "disk"
    assert bytes(sealing.open_view(sessions[0], store.read(sessions[0].key))) == PAYLOAD
    assert store.read(sessions[1].key) is states[1]
    store.discard(sessions[1].key)
    assert states[1].closed
    taken = store.read(sessions[2].key)
    store.discard(sessions[2].key, close=False)  # a restore takes it: still open, the caller's
    assert not taken.closed
    taken.close()
    store.close()


def test_a_memfd_that_cannot_be_sealed_arrives_as_bytes(pipe) -> None:
    supervisor, worker = pipe
    fd = os.memfd_create("unsealable")  # no MFD_ALLOW_SEALING
    os.write(fd, b"\0" * 8 + PAYLOAD + b"\0" * 4)
    worker.send_bytes(msgspec.msgpack.Encoder().encode(Saved(length=9, blob_bytes=len(PAYLOAD), head=8, tail=4)))
    with socket.socket(fileno=os.dup(worker.fileno())) as sock:
        socket.send_fds(sock, [b"S"], [fd])
    os.close(fd)
    before = open_descriptors()
    blob = receive_reply(supervisor, msgspec.msgpack.Decoder(AnyWorkerReply)).blob
    assert type(blob) is bytes and blob == PAYLOAD
    assert open_descriptors() - before == set()


def test_a_received_state_can_no_longer_change_size(pipe) -> None:
    """Its size sealed as it arrives: a sender that truncated it would otherwise fault the reader's mapping."""
    sealing, session = StateSeal(UNBOUND), _session()
    shared = _saved(pipe, sealing, session)
    with pytest.raises(PermissionError):
        os.ftruncate(shared.fd, 0)
    assert bytes(shared.payload) == PAYLOAD
    shared.close()


def test_the_connection_limit_leaves_the_shared_states_their_descriptors(monkeypatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (600, 600))
    monkeypatch.setattr(SharedState, "limit", 0)
    without = derived_max_connections()
    monkeypatch.setattr(SharedState, "limit", 150)
    assert derived_max_connections() == without - 150


def test_a_memfd_that_refuses_its_seal_is_sealed_as_a_copy(pipe, monkeypatch) -> None:
    sealing, session = StateSeal(UNBOUND), _session()
    shared = _saved(pipe, sealing, session)

    def refuse(_self) -> None:
        raise OSError(16, "busy")

    monkeypatch.setattr(SharedState, "seal", refuse)
    sealed = sealing.seal(session, shared)
    assert type(sealed) is bytes and shared.closed and bytes(sealing.open_view(session, sealed)) == PAYLOAD

"""The direct channel: a bound session's appends go client -> worker, and the supervisor stays the
authority: whatever it does to the session first revokes the channel, and the next append gets exactly
the typed error (or restore) the supervisor gives."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import secrets
import select
import selectors
import socket
import struct
import termios
import threading
import time

import numpy as np
import pytest

from kvpool.client.client import KvpoolError, append_request
from kvpool.client.connection import ClientConnection
from kvpool.daemon.pool.spec import PoolSpec, shared_settings
from kvpool.host import FRAME_DEADLINE_ENV, direct_frame_deadline_s
from kvpool.wire.framing import FRAME_HEADER, REUSED_PAYLOAD_BYTES, receive_exactly
from kvpool.wire.protocol import Append, AppendReply, decode_reply, encode
from tests.support.daemons import HANG_GUARD_S, DaemonProcess, in_thread, joined, refused, stopped, wait_until
from workers.server.direct import MAX_FRAME_BYTES, DirectChannel
from workers.server.segment import CONTROL_BYTES, SegmentRegions
from workers.server.spec import FRAME_DEADLINE_S

N_CTX = 256
pytestmark = pytest.mark.timeout(3600)


def _serve(model_path, socket_dir, name, *options):
    return DaemonProcess(model_path, socket_dir / f"{name}.sock", "--threads", "1", "--n-ctx", str(N_CTX), *options)




def _direct_appends(client) -> int:
    return client.stats().counters["direct_appends"]


def test_appends_skip_the_supervisor_and_equal_the_supervisor_path(model_path, socket_dir, prompt_ids):
    daemon = _serve(model_path, socket_dir, "paths", "--max-sessions", "2")
    prompt = prompt_ids[0][:10]
    try:
        with daemon.client() as direct, daemon.client(direct=False) as plain:
            outputs, copies = {}, {}
            for name, client in (("d", direct), ("p", plain)):
                rows = [client.append(name, 1, 0, tokens=prompt).rows]
                for step in range(4):
                    rows.append(client.append(name, 1, 10 + step, tokens=[30 + step]).rows)
                    copies.setdefault(name, []).append(rows[-1].copy())  # as it came, before the next reply was read
                outputs[name] = rows
            for left, right in zip(outputs["d"], outputs["p"]):
                assert np.array_equal(left, right)
            for name in outputs:  # a reply's rows are the caller's: the next reply (read into the same buffer) leaves them be
                assert all(np.array_equal(kept, now) for kept, now in zip(copies[name], outputs[name][1:]))
                assert not np.array_equal(outputs[name][1], outputs[name][2])
            stats = plain.stats()
            assert stats.counters["direct_appends"] == 4 and stats.counters["appends"] == 6  # 1 + 5 through the supervisor
            assert {row.session_id: row.length for row in stats.sessions} == {"d": 14, "p": 14}
            # a direct append's errors are the supervisor's, word for word
            via_direct = refused(lambda: direct.append("d", 1, 3, tokens=[1]))
            assert (via_direct.code, via_direct.length) == ("position_mismatch", 14)
            direct_count = _direct_appends(plain)
            via_plain = refused(lambda: plain.append("d", 1, 3, tokens=[1]))
            assert (via_plain.code, via_plain.length, str(via_plain)) == (via_direct.code, via_direct.length, str(via_direct))
            assert _direct_appends(plain) == direct_count
            assert refused(lambda: direct.append("d", 1, 14, tokens=[10**6])).code == "bad_request"
            assert stats.integrity == "ok"
    finally:
        daemon.stop()


def test_revocation_release_epoch_eviction_truncate_and_park(model_path, socket_dir, whole_model, prompt_ids):
    daemon = _serve(model_path, socket_dir, "revoke", "--max-sessions", "1", "--spill-budget", "0")
    prompt = prompt_ids[1][:8]
    try:
        with daemon.client() as router, daemon.client(direct=False) as other:
            router.append("a", 1, 0, tokens=prompt)
            router.append("a", 1, 8, tokens=[5])  # direct now
            other.release("a", 1)
            assert refused(lambda: router.append("a", 1, 9, tokens=[5])).reason == "released"
            router.append("b", 1, 0, tokens=prompt)
            router.append("b", 1, 8, tokens=[5])
            other.append("b", 2, 0, tokens=prompt)  # a newer epoch fences the old one
            assert refused(lambda: router.append("b", 1, 9, tokens=[5])).code == "stale_epoch"
            router.append("c", 1, 0, tokens=prompt)  # the only place: evicts b (epoch 2), bound to its channel
            router.append("c", 1, 8, tokens=[5])
            other.append("d", 1, 0, tokens=prompt)  # evicts c
            assert refused(lambda: router.append("c", 1, 9, tokens=[5])).reason == "evicted"
            router.append("d", 1, 8, tokens=[5])
            assert other.truncate("d", 1, 4) == 4
            assert refused(lambda: router.append("d", 1, 9, tokens=[5])).code == "position_mismatch"
            got = router.append("d", 1, 4, tokens=[5])
            with whole_model.new_context(N_CTX) as reference:
                reference.append(0, tokens=np.asarray(prompt[:4], np.int32))
                assert np.array_equal(got.rows, reference.append(4, tokens=np.asarray([5], np.int32)))
            assert other.stats().integrity == "ok"
    finally:
        daemon.stop()
    parked = _serve(model_path, socket_dir, "revoke-park", "--max-sessions", "1")
    try:
        with parked.client() as router, parked.client(direct=False) as other:
            router.append("p", 1, 0, tokens=prompt)
            router.append("p", 1, 8, tokens=[5])
            assert other.park("p", 1).length == 9  # the park's save revoked the channel: the direct append's length
            got = router.append("p", 1, 9, tokens=[6])
            assert got.restored
            with whole_model.new_context(N_CTX) as reference:
                reference.append(0, tokens=np.asarray(prompt, np.int32))
                reference.append(8, tokens=np.asarray([5], np.int32))
                assert np.array_equal(got.rows, reference.append(9, tokens=np.asarray([6], np.int32)))
                router.append("p", 1, 10, tokens=[7])  # direct again; parked, cut to 6 while parked, then restored
                assert other.park("p", 1).length == 11 and other.truncate("p", 1, 6) == 6
                got = router.append("p", 1, 6, tokens=[8])
                reference.truncate(6)
                assert got.restored and np.array_equal(got.rows, reference.append(6, tokens=np.asarray([8], np.int32)))
                assert other.stats().counters["restores_in_place"] == 2  # both into the spare their own park left: nothing loaded
                # another session takes the only place (p parked for it, its spare cleared for q), then p takes it back
                # (q parked): into q's spare, cleared, p's stored state loaded
                other.append("q", 1, 0, tokens=prompt[:4])
                got = router.append("p", 1, 7, tokens=[9])
                assert got.restored and np.array_equal(got.rows, reference.append(7, tokens=np.asarray([9], np.int32)))
            counters = other.stats().counters
            assert counters["restores"] == 3 and counters["restores_in_place"] == 2 and counters["misses"] == 0
    finally:
        parked.stop()


def test_an_eviction_revokes_the_channel_even_when_the_admitting_append_is_then_refused(model_path, socket_dir, prompt_ids):
    """The warm tier off: d's admission evicts c and takes over c's worker, whose context d's first run replaces. Here that
    run never comes (8 tokens into n_ctx 4: context_full, after the admission). Before the fix nothing had told the worker,
    and c's direct appends went on being served on its old context; now the victim's channel is revoked before it is evicted."""
    daemon = _serve(model_path, socket_dir, "evict-refused", "--max-sessions", "1", "--spill-budget", "0", "--min-residency", "0")
    prompt = prompt_ids[1][:8]
    try:
        with daemon.client() as router, daemon.client(direct=False) as other:
            router.append("c", 1, 0, tokens=prompt)
            router.append("c", 1, 8, tokens=[5])  # direct
            assert refused(lambda: other.append("d", 1, 0, tokens=prompt, n_ctx=4)).code == "context_full"
            assert refused(lambda: router.append("c", 1, 9, tokens=[5])).reason == "evicted"
            assert other.stats().integrity == "ok"
    finally:
        daemon.stop()


def test_a_copy_written_behind_leaves_the_direct_channel_bound(model_path, socket_dir, tmp_path, whole_model, prompt_ids):
    """--persist-after: the copy's save revokes the channel in the worker (every command does) and the supervisor
    binds it again at once: the next append still goes straight to the worker, and the copy holds the length of
    the direct appends before it."""
    daemon = _serve(model_path, socket_dir, "persist-channel", "--max-sessions", "1", "--spill-dir", str(tmp_path / "spill"),
                    "--spill-disk-budget", "64MiB", "--persist-after", "2")  # far above a step on a slow, busy machine: one copy, at 9
    prompt = prompt_ids[1][:8]
    try:
        with daemon.client() as router, daemon.client(direct=False) as other, whole_model.new_context(N_CTX) as reference:
            reference.append(0, tokens=np.asarray(prompt, np.int32))
            router.append("w", 1, 0, tokens=prompt)
            router.append("w", 1, 8, tokens=[5])  # direct
            reference.append(8, tokens=np.asarray([5], np.int32))
            wait_until(lambda: other.stats().counters.get("persisted", 0) >= 1, "a copy written behind")
            before = other.stats().counters
            got = router.append("w", 1, 9, tokens=[6])
            after = other.stats().counters
            assert np.array_equal(got.rows, reference.append(9, tokens=np.asarray([6], np.int32)))
            assert after["direct_appends"] == before["direct_appends"] + 1 and after["appends"] == before["appends"]
            assert after["persisted"] >= 1 and after["persist_failures"] == 0 and after["misses"] == 0
    finally:
        daemon.stop()


def test_cancel_reaches_a_direct_append_running_or_not_yet_read(model_path, socket_dir, tokenizer):
    daemon = _serve(model_path, socket_dir, "cancel", "--max-sessions", "2", "--n-ctx", "2048")
    long_prompt = tokenizer.encode(" ".join(f"word{i}" for i in range(900)))[:1900]
    try:
        with daemon.client() as client, daemon.client(direct=False) as observer:
            client.append("cancel", 1, 0, tokens=long_prompt[:10])
            client.append("cancel", 1, 10, tokens=long_prompt[10:12])  # bound: the next one goes direct
            worker_pid = observer.stats().sessions[0].worker_pid
            with stopped(worker_pid):
                thread, outcome = in_thread(lambda: client.append("cancel", 1, 12, tokens=long_prompt[12:]))
                wait_until(lambda: client.direct_in_flight("cancel", 1), "the direct append to be sent")
                canceller, cancelled = in_thread(lambda: client.cancel("cancel", 1))
                wait_until(lambda: observer.stats().counters["direct_cancels_forwarded"], "the cancel to reach the worker's pipe")
            assert joined(canceller, cancelled)["result"].detail == "cancel requested"
            error = joined(thread, outcome).get("error")
            assert isinstance(error, KvpoolError) and (error.code, error.length) == ("cancelled", 12), outcome
            assert observer.stats().sessions[0].length == 12
            logits = client.append("cancel", 1, 12, tokens=long_prompt[12:40]).rows
            fresh = observer.append("fresh", 1, 0, tokens=long_prompt[:40]).rows
            assert np.array_equal(logits, fresh)
            assert client.cancel("cancel", 1).detail == "nothing in flight"
    finally:
        daemon.stop()


def test_an_idle_direct_session_is_the_least_recently_used_only_when_it_is(model_path, socket_dir, prompt_ids):
    daemon = _serve(model_path, socket_dir, "lru", "--max-sessions", "2", "--spill-budget", "0")
    prompt = prompt_ids[0][:6]
    try:
        with daemon.client() as client, daemon.client(direct=False) as other:
            client.append("old", 1, 0, tokens=prompt)
            other.append("busy", 1, 0, tokens=prompt)
            time.sleep(0.01)
            client.append("old", 1, 6, tokens=[1])  # a direct append: "old" is now the most recently used
            other.append("new", 1, 0, tokens=prompt)  # evicts "busy", not "old"
            assert {row.session_id for row in other.stats().sessions} == {"old", "new"}
    finally:
        daemon.stop()


# ---- a peer never holds the worker: a frame passes whole within the deadline, or the peer is dropped ---

TRICKLE_INTERVAL_S = 0.25  # a byte this often: each recv is far inside a per-recv limit (today's main: 30 s)
TRICKLE_S = 90.0  # the trickle's schedule: far longer than a Truncate takes, and than the deadline below
SHORT_DEADLINE_S = 3.0  # the trickle daemon's frame deadline (KVPOOL_DIRECT_FRAME_DEADLINE_S)


def _unsent_bytes(peer: socket.socket) -> int:
    """Bytes `peer` sent that the other end has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(peer, termios.TIOCOUTQ, struct.pack("i", 0)))[0]


def _unread_bytes(peer: socket.socket) -> int:
    """Bytes waiting to be read on `peer` (SIOCINQ)."""
    return struct.unpack("i", fcntl.ioctl(peer, termios.FIONREAD, struct.pack("i", 0)))[0]


def _admit_with_channel(daemon, session_id: str, tokens) -> str:
    """Admit the session with Append.direct through the daemon; the direct channel's address it names."""
    connection = ClientConnection(str(daemon.socket), HANG_GUARD_S, "admit")
    try:
        reply = connection.request(append_request(session_id, 1, 0, tokens=tokens, direct=True))
    finally:
        connection.close()
    assert isinstance(reply, AppendReply) and reply.channel, reply
    return reply.channel


def _connect(address: str) -> socket.socket:
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.settimeout(HANG_GUARD_S)  # a hang guard: every read below waits for an event
    peer.connect("\0" + address)
    return peer


def _trickle(peer: socket.socket, stop: threading.Event) -> None:
    """One byte every TRICKLE_INTERVAL_S until TRICKLE_S have passed (or `stop`); a dropped peer's sends
    fail and the schedule runs on: the test orders events against the schedule, not against the drop."""
    ends = time.monotonic() + TRICKLE_S
    while not stop.wait(TRICKLE_INTERVAL_S) and time.monotonic() < ends:
        try:
            peer.send(b"\0")
        except OSError:
            pass


def _reference(model, tokens, then, output_rows="last") -> np.ndarray:
    with model.new_context(N_CTX) as reference:
        reference.append(0, tokens=np.asarray(tokens, np.int32))
        return np.array(reference.append(len(tokens), tokens=np.asarray(then, np.int32), output_rows=output_rows), copy=True)


def test_a_peer_trickling_a_frame_holds_neither_the_supervisor_nor_the_session(model_path, socket_dir, prompt_ids, whole_model, monkeypatch):
    monkeypatch.setenv(FRAME_DEADLINE_ENV, str(SHORT_DEADLINE_S))
    daemon = _serve(model_path, socket_dir, "trickle", "--max-sessions", "1")
    prompt = prompt_ids[0][:8]
    stop = threading.Event()
    try:
        address = _admit_with_channel(daemon, "t", prompt)
        with daemon.client() as client, daemon.client(direct=False) as observer, _connect(address) as peer:
            started = time.monotonic()
            peer.sendall(FRAME_HEADER.pack(4096) + b"\0")  # a frame of 4096 bytes, the trickle never completes
            wait_until(lambda: _unsent_bytes(peer) == 0, "the worker to read the frame's first bytes")
            trickler = threading.Thread(target=_trickle, args=(peer, stop))
            trickler.start()
            assert observer.truncate("t", 1, 4) == 4
            assert trickler.is_alive(), "the Truncate waited for the trickling peer"
            direct_before = _direct_appends(observer)
            got = [client.append("t", 1, 4, tokens=[5]).rows, client.append("t", 1, 5, tokens=[6]).rows]  # the second direct
            assert _direct_appends(observer) == direct_before + 1
            assert np.array_equal(got[0], _reference(whole_model, prompt[:4], [5]))
            assert np.array_equal(got[1], _reference(whole_model, [*prompt[:4], 5], [6]))
            assert peer.recv(1) == b""  # dropped: the frame did not pass whole within the deadline
            assert time.monotonic() - started >= SHORT_DEADLINE_S  # and not before it
            assert trickler.is_alive()
            assert observer.stats().integrity == "ok"
    finally:
        stop.set()
        daemon.stop()


def test_a_peer_not_reading_its_reply_holds_neither_the_supervisor_nor_the_reply(model_path, socket_dir, prompt_ids, whole_model, monkeypatch):
    monkeypatch.setenv(FRAME_DEADLINE_ENV, str(HANG_GUARD_S))  # the reply waits for its reader (past it: a hang)
    daemon = _serve(model_path, socket_dir, "slow-reader", "--max-sessions", "1")
    prompt, more = prompt_ids[0][:8], prompt_ids[1][:16]
    try:
        address = _admit_with_channel(daemon, "r", prompt)
        with daemon.client() as client, daemon.client(direct=False) as observer, _connect(address) as peer:
            request = append_request("r", 1, 8, tokens=more, output_rows="all")
            request.request_id = 7
            peer.sendall(encode(request))  # its reply, 16 rows of 49152 logits, is far larger than the socket's buffer
            wait_until(lambda: _unread_bytes(peer) > 0, "the worker to start writing the reply")
            assert observer.truncate("r", 1, 4) == 4  # while the reply is still being written
            (size,) = FRAME_HEADER.unpack(receive_exactly(peer, FRAME_HEADER.size))
            payload = receive_exactly(peer, size)
            assert payload is not None, "the worker dropped the reply half-written"
            reply = decode_reply(payload)
            assert isinstance(reply, AppendReply) and (reply.request_id, reply.length, reply.rows) == (7, 24, 16)
            assert np.array_equal(np.frombuffer(reply.data, "<f4").reshape(16, -1), _reference(whole_model, prompt, more, "all"))
            assert np.array_equal(client.append("r", 1, 4, tokens=[5]).rows, _reference(whole_model, prompt[:4], [5]))
            assert observer.stats().integrity == "ok"
    finally:
        daemon.stop()


class _Segment:
    """What DirectChannel takes of a worker's segment: its buffer (the control words)."""

    def __init__(self) -> None:
        self.buf = bytearray(CONTROL_BYTES)


class _Channel:
    """A DirectChannel on a fake segment, without a server; `pump` serves what is ready, as the worker's
    loop does, without counting the time (the test says how long the worker waited)."""

    def __init__(self, deadline_s: float, reply=None) -> None:
        self.selector = selectors.DefaultSelector()
        self._pipe = multiprocessing.Pipe()  # the cancel pipe: nothing is sent on it here
        self.address = f"kvpool-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.channel = DirectChannel(self.address, None, _Segment(), self._pipe[1], self.selector, deadline_s)
        if reply is not None:
            self.channel._append = lambda request: reply  # the compute is not under test here

    def connect(self) -> socket.socket:
        peer = _connect(self.address)
        self.pump()
        return peer

    def pump(self) -> None:
        """Serve until nothing is ready (each round waits a little for the kernel to pass bytes on)."""
        while events := self.selector.select(0.05):
            for key, ready in events:
                self.channel.ready(key.data, ready)

    def close(self) -> None:
        self.channel.close()
        for end in self._pipe:
            end.close()
        self.selector.close()


def _open(peer: socket.socket) -> bool:
    """The worker has not closed `peer` (nothing to read, no EOF)."""
    readable, _, _ = select.select([peer], [], [], 0)
    return not readable or peer.recv(1, socket.MSG_PEEK) != b""


def test_a_frame_passes_whole_within_the_deadline_of_waiting_for_it_or_its_peer_is_dropped():
    harness = _Channel(10.0)
    channel = harness.channel
    try:
        idle, partial, late = harness.connect(), harness.connect(), harness.connect()
        partial.sendall(FRAME_HEADER.pack(10) + b"abc")
        late.sendall(FRAME_HEADER.pack(10) + b"abc")
        harness.pump()
        assert channel.next_wait() == pytest.approx(10.0)
        channel.waited(9.5)
        late.sendall(b"defghij")  # the rest, inside the deadline: served (a bad request, answered and closed)
        harness.pump()
        (size,) = FRAME_HEADER.unpack(receive_exactly(late, FRAME_HEADER.size))
        assert decode_reply(receive_exactly(late, size)).code == "bad_request"
        assert late.recv(1) == b""
        assert channel.next_wait() == pytest.approx(0.5)
        assert _open(partial)
        channel.waited(0.5)  # the deadline, to the second: dropped
        assert channel.next_wait() is None  # no frame passing any more
        assert partial.recv(1) == b""
        channel.waited(1000.0)  # a peer between frames has no deadline
        assert channel.next_wait() is None and _open(idle)
        idle.sendall(FRAME_HEADER.pack(MAX_FRAME_BYTES) + b"x")  # the largest frame: read on
        harness.pump()
        assert _open(idle)
        too_large = harness.connect()
        too_large.sendall(FRAME_HEADER.pack(MAX_FRAME_BYTES + 1))
        harness.pump()
        assert too_large.recv(1) == b""
    finally:
        harness.close()


def test_a_request_frame_over_the_channels_limit_drops_its_peer_at_the_edge():
    harness = _Channel(10.0)
    harness.channel.max_frame_bytes = 4096  # as the daemon's --max-request-bytes sets it (WorkerSpec.max_request_bytes)
    try:
        largest, too_large = harness.connect(), harness.connect()
        largest.sendall(FRAME_HEADER.pack(4096) + b"x")  # the largest frame: read on
        too_large.sendall(FRAME_HEADER.pack(4097))  # one byte over: dropped before any payload is read
        harness.pump()
        assert _open(largest)
        assert not _open(too_large)  # closed by the worker (end of file waiting)
    finally:
        harness.close()


def test_the_direct_channel_takes_no_request_larger_than_the_daemons_socket_does(model_path, socket_dir, prompt_ids):
    """--max-request-bytes bounds the direct channel as it bounds the daemon's socket: a frame over it is not read
    there either (its peer is dropped; the client asks the daemon, which refuses the frame: bad_request)."""
    daemon = _serve(model_path, socket_dir, "request-bytes", "--n-ctx", "1024", "--max-request-bytes", "1024")
    try:
        with daemon.client() as client:
            client.append("big", 1, 0, tokens=prompt_ids[0][:8])
            client.append("big", 1, 8, tokens=[5])  # bound: direct from here
            assert _direct_appends(client) == 1
            large = refused(lambda: client.append("big", 1, 9, tokens=[30000] * 400))  # ~1.2 KB of msgpack, 400 rows that fit n_ctx
            assert large.code == "bad_request" and "exceeds the limit of 1024" in str(large)
            assert _direct_appends(client) == 1
            assert {row.session_id: row.length for row in client.stats().sessions} == {"big": 9}
            assert client.append("big", 1, 9, tokens=[30000] * 100).length == 109  # under the limit: served (by the daemon,
            assert client.append("big", 1, 109, tokens=[5]).length == 110  # which binds the channel again: direct from here)
            assert _direct_appends(client) == 2
    finally:
        daemon.stop()


def test_a_reply_passes_whole_within_the_deadline_or_its_peer_is_dropped():
    large = AppendReply(request_id=3, session_id="s", epoch=1, length=1, rows=1, width=1, data=b"\0" * (8 * 1024**2))
    harness = _Channel(10.0, reply=large)
    channel = harness.channel
    try:
        reader, stalled = harness.connect(), harness.connect()
        frame = encode(Append(session_id="s", epoch=1, start_pos=0, tokens=[1]))
        reader.sendall(frame)
        stalled.sendall(frame)
        harness.pump()
        assert channel.next_wait() == pytest.approx(10.0)  # both replies are being written
        channel.waited(9.5)
        got = bytearray()
        while len(got) < len(encode(large)):  # the reader takes its reply within the deadline
            got += reader.recv(1024**2)
            harness.pump()
        assert decode_reply(bytes(got[FRAME_HEADER.size :])) == large
        channel.waited(0.5)
        assert channel.next_wait() is None
        received = 0
        while chunk := stalled.recv(1024**2):  # what was written, then EOF: dropped mid-reply
            received += len(chunk)
        assert 0 < received < len(encode(large))
        assert _open(reader)
    finally:
        harness.close()


def test_a_peers_replies_are_encoded_into_one_buffer_and_each_goes_out_whole():
    """Each reply is encoded into the peer's own buffer (a last shard's logits every step: no new allocation), larger
    or smaller than the last, and the peer reads each whole and intact; a buffer over REUSED_PAYLOAD_BYTES (a prefill's
    rows) is not kept once its frame is out."""
    sizes = (300_000, 4_000, 600_000, 600_000, REUSED_PAYLOAD_BYTES + 1, 5_000)
    replies = [AppendReply(request_id=index, session_id="s", epoch=1, length=index, rows=1, width=size // 4, data=bytes([index]) * size)
               for index, size in enumerate(sizes, start=1)]
    harness = _Channel(10.0)
    served = iter(replies)
    harness.channel._append = lambda request: next(served)
    try:
        reader = harness.connect()
        (peer,) = harness.channel._peers
        buffer = peer._frame
        for reply in replies:
            reader.sendall(encode(Append(session_id="s", epoch=1, start_pos=0, tokens=[1])))
            expected = encode(reply)
            got = bytearray()
            while len(got) < len(expected):
                harness.pump()
                got += reader.recv(1024**2)
            assert bytes(got) == expected
            if len(expected) > REUSED_PAYLOAD_BYTES:
                assert len(peer._frame) == 0  # let go
                buffer = peer._frame
            else:
                assert peer._frame is buffer and bytes(buffer) == expected  # the same buffer, holding this frame exactly
    finally:
        harness.close()


def test_the_frame_deadline_is_the_daemons_setting_and_refuses_what_is_not_a_positive_time(monkeypatch):
    monkeypatch.delenv(FRAME_DEADLINE_ENV, raising=False)
    assert direct_frame_deadline_s(FRAME_DEADLINE_S) == FRAME_DEADLINE_S == 30.0
    for text in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv(FRAME_DEADLINE_ENV, text)
        with pytest.raises(ValueError, match=FRAME_DEADLINE_ENV):
            direct_frame_deadline_s(FRAME_DEADLINE_S)
    monkeypatch.setenv(FRAME_DEADLINE_ENV, "0.001")
    spec = PoolSpec(worker=shared_settings(shard_path="x", segment=SegmentRegions(input_bytes=4, output_bytes=4), n_threads=1, flash_attn=False),
                    size=1, ready_timeout_s=1, request_timeout_s=1)
    assert spec.worker_spec(shm_name="m", parent_pid=1).frame_deadline_s == 0.001

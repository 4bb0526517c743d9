"""The daemon's socket transport (kvpool.daemon.transport.frames) at its limits, on real daemons unless said otherwise:
control requests (Cancel, Stats) are read on a connection whose in-flight limit is reached; a Hello must
arrive within the handshake deadline and every frame within the frame deadline (an idle connection stays
open); request bytes held across all connections stay within --max-buffered-bytes; one connection past
--max-connections gets a typed refusal (and under a small open-files limit, accept never runs out of
descriptors); live sessions are served throughout. Waits are hang guards only."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import resource
import select
import socket
import subprocess
import time

import psutil
import pytest

from kvpool.client.client import Client, KvpoolError
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.transport import frames as server
from kvpool.wire.framing import FRAME_HEADER
from kvpool.wire.protocol import (
    PROTOCOL_VERSION,
    Append,
    Cancel,
    Done,
    ErrorReply,
    Hello,
    HelloReply,
    ShardDescription,
    Stats,
    StatsReply,
    encode,
)
from kvpool.wire.shape import ShardShape
from tests.conftest import EVEN_SPLIT
from tests.support.daemons import HANG_GUARD_S, DaemonProcess, RawConnection, admission_line_full, stopped, wait_until

pytestmark = pytest.mark.timeout(3600)
ONE_PLACE = ("--threads", "1", "--n-ctx", "256", "--max-sessions", "1")
# A daemon that does not close a connection it should have closed leaves the test's read waiting: this
# guard ends that wait (a daemon with the deadlines closes it within a few seconds of them).
CLOSE_GUARD_S = 60.0
MiB = 1024**2


@pytest.fixture(scope="module")
def first_shard(shard_sets):
    return shard_sets[EVEN_SPLIT][0]


def _raw(daemon, *, hello: bool = True, timeout_s: float = HANG_GUARD_S) -> RawConnection:
    connection = RawConnection(daemon.socket, hello=hello)
    connection.sock.settimeout(timeout_s)
    return connection


def _session_with_a_place(daemon, session_id: str) -> Client:
    """A client (its main connection only) holding a live session of 3 positions."""
    client = daemon.client(direct=False)
    assert client.append(session_id, 1, 0, tokens=[1, 2, 3]).length == 3
    return client


# ---- pure parts: the byte allowance and a connection's in-flight places ----------------------------


def test_byte_allowance_takes_what_fits_at_once_queues_the_rest_and_gives_back_exactly():
    from kvpool.daemon.transport.allowance import ByteAllowance  # here: the module must import where this one does not exist

    async def main():
        allowance = ByteAllowance(100)
        first = await allowance.take(60)
        big = asyncio.create_task(allowance.take(50))
        await asyncio.sleep(0)
        assert not big.done() and allowance.waiting == 1
        small = await allowance.take(40)  # fits: not held up behind the waiting 50
        assert allowance.held == 100
        first.give_back()
        first.give_back()  # idempotent
        held_big = await big
        assert allowance.held == 90 and allowance.waiting == 0
        cancelled = asyncio.create_task(allowance.take(20))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert allowance.waiting == 0 and allowance.held == 90
        small.give_back()
        held_big.give_back()
        assert allowance.held == 0
        with pytest.raises(ValueError):
            await allowance.take(101)  # can never fit: refused, not queued
        exactly = await allowance.take(100)  # the edge: the whole allowance
        exactly.give_back()
        return allowance.held

    assert asyncio.run(main()) == 0


def test_in_flight_holds_the_limit_plus_one_control_request_and_no_more():
    async def main():
        in_flight = server.InFlight(2)
        frees = [await in_flight.take(control=False) for _ in range(2)]
        await asyncio.wait_for(in_flight.room_to_read(), 1)  # at the limit: one more frame may be read
        non_control = asyncio.create_task(in_flight.take(control=False))
        await asyncio.sleep(0)
        assert not non_control.done()  # held until a place frees
        free_control = await in_flight.take(control=True)  # beside the limit
        reading = asyncio.create_task(in_flight.room_to_read())
        await asyncio.sleep(0)
        assert not reading.done()  # the limit and the control place are taken: nothing more is read
        free_control()
        await reading
        frees[0]()
        frees.append(await non_control)
        return in_flight.requests, in_flight.control_beyond_limit

    assert asyncio.run(main()) == (2, False)


def test_transport_settings_are_validated_at_their_edges():
    def config(**fields) -> ServeConfig:
        return ServeConfig(model=pathlib.Path("m.gguf"), socket=pathlib.Path("/tmp/x.sock"), **fields)

    assert config().buffered_request_limit_bytes == 256 * MiB
    assert config(max_request_bytes=300 * MiB).buffered_request_limit_bytes == 300 * MiB  # at least one largest frame
    assert config(max_request_bytes=8 * MiB, max_buffered_bytes=8 * MiB).buffered_request_limit_bytes == 8 * MiB
    for fields, problem in (
        ({"max_request_bytes": 8 * MiB, "max_buffered_bytes": 8 * MiB - 1}, "--max-buffered-bytes"),
        ({"handshake_timeout_s": 0.0}, "--handshake-timeout"),
        ({"frame_timeout_s": 0.0}, "--frame-timeout"),
        ({"max_connections": 0}, "--max-connections"),
    ):
        with pytest.raises(ValueError, match=problem):
            config(**fields)
    assert config(max_connections=1, handshake_timeout_s=0.001, frame_timeout_s=0.001).max_connections == 1


# ---- a SocketTransport in this process, a fake dispatch: the allowance's books after every path --------


def _hello_reply() -> HelloReply:
    shape = ShardShape(layer_start=0, layer_stop=30, total_layers=30, n_embd=576, n_vocab=49152)
    return HelloReply(version=PROTOCOL_VERSION, shard=ShardDescription(shape=shape, model_path="x"), max_n_ctx=64, default_n_ctx=64, max_request_bytes=MiB)


def test_frames_past_the_byte_bound_wait_unread_and_every_path_gives_the_bytes_back(socket_dir):
    """The bound is 1 MiB: of three connections declaring 600 KiB frames one is read, two wait; a small
    request still fits; answered requests and connections closed mid-frame give back what they held."""
    path = socket_dir / "inproc.sock"
    limits = server.ConnectionLimits(handshake_timeout_s=HANG_GUARD_S, frame_timeout_s=HANG_GUARD_S, buffered_request_bytes=MiB, max_connections=8)

    async def dispatch(request):
        return Done(length=0, detail=type(request).__name__)

    async def main():
        frames = server.SocketTransport(path, _hello_reply(), dispatch, max_request_bytes=MiB, limits=limits)
        await frames.start()
        try:
            big = 600 * 1024
            raws = [await asyncio.to_thread(RawConnection, path) for _ in range(3)]
            for raw in raws:
                await asyncio.to_thread(raw.send, FRAME_HEADER.pack(big) + b"\x00" * 1000)
            await _until(lambda: frames.allowance.held == big and frames.allowance.waiting == 2)
            small = await asyncio.to_thread(RawConnection, path)
            await asyncio.to_thread(small.send, encode(Stats(request_id=7)))
            reply = await asyncio.to_thread(small.read)
            assert isinstance(reply, Done) and reply.request_id == 7
            await _until(lambda: frames.allowance.held == big)  # the Stats' bytes were given back
            for raw in raws + [small]:
                raw.close()
            await _until(lambda: frames.allowance.held == 0 and frames.allowance.waiting == 0 and frames.listener.open_connections == 0)
        finally:
            await frames.close()

    asyncio.run(asyncio.wait_for(main(), HANG_GUARD_S))


async def _until(predicate) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while not predicate():
            await asyncio.sleep(0.01)


# ---- issue 17 item 3: control requests reach a connection at its in-flight limit -------------------


WAITING = server.MAX_IN_FLIGHT_PER_CONNECTION - 1  # appends waiting for admission beside one prefill: the limit


@pytest.fixture
def one_place(first_shard, socket_dir):
    """One place, and an admission line of WAITING: a full line shows that all of them wait."""
    daemon = DaemonProcess(first_shard.path, socket_dir / "one.sock", *ONE_PLACE, "--admit-queue", str(WAITING))
    try:
        yield daemon
    finally:
        daemon.stop()


def test_cancel_and_stats_are_read_on_a_connection_at_its_in_flight_limit(one_place, prompt_ids):
    """One raw connection: a prefill held in flight by its stopped worker plus appends waiting for the
    only place fill the connection's limit; Cancel and Stats sent behind them are answered before any of
    those (the waiting admissions give up after kvpool.daemon.admission.admission.MAX_ADMIT_WAIT_S at the earliest), and
    the prefill ends cancelled."""
    long_prompt = (prompt_ids[1] * 8)[:200]
    waiting = WAITING
    with one_place.client(direct=False) as observer:
        observer.append("long", 1, 0, tokens=long_prompt[:10])
        worker = next(row.worker_pid for row in observer.stats().sessions)
        raw = _raw(one_place)
        try:
            with stopped(worker):
                raw.send(encode(Append(session_id="long", epoch=1, start_pos=10, tokens=long_prompt[10:], request_id=1)))
                wait_until(lambda: any(row.in_flight for row in observer.stats().sessions), "the prefill to be in flight")
                raw.send(b"".join(
                    encode(Append(session_id=f"wait-{index}", epoch=1, start_pos=0, tokens=[1], admit_timeout_s=HANG_GUARD_S, request_id=100 + index))
                    for index in range(waiting)
                ))
                wait_until(lambda: admission_line_full(observer), "the appends to wait for admission")
                raw.send(encode(Cancel(session_id="long", epoch=1, request_id=2)) + encode(Stats(request_id=3)))
                first, second = raw.read(), raw.read()
            rest = [raw.read() for _ in range(1 + waiting)]
        finally:
            raw.close()
    assert isinstance(first, Done) and first.request_id == 2, f"the first reply is not the cancel's: {first!r}"
    assert first.detail == "cancel requested"
    assert isinstance(second, StatsReply) and second.request_id == 3
    assert sum(row.in_flight for row in second.sessions) == 1
    prefill = next(reply for reply in rest if reply.request_id == 1)
    assert isinstance(prefill, ErrorReply) and prefill.code == "cancelled" and prefill.length == 10
    assert sorted(reply.request_id for reply in rest if reply.request_id != 1) == list(range(100, 100 + waiting))


# ---- issue 17 item 6: deadlines -----------------------------------------------------------------------


@pytest.fixture
def strict(first_shard, socket_dir):
    daemon = DaemonProcess(first_shard.path, socket_dir / "strict.sock", *ONE_PLACE, "--handshake-timeout", "1", "--frame-timeout", "2")
    try:
        yield daemon
    finally:
        daemon.stop()


def _closing_notice(raw: RawConnection) -> ErrorReply:
    """The daemon's last word on a connection it closes, then its end of file."""
    try:
        notice = raw.read()
    except TimeoutError:
        pytest.fail(f"the connection is still open {CLOSE_GUARD_S:.0f} s later")
    assert isinstance(notice, ErrorReply) and notice.code == "bad_request", notice
    assert raw.read() is None, "the connection stayed open after its closing notice"
    return notice


def test_connections_that_miss_the_handshake_or_frame_deadline_are_closed_and_idle_ones_stay(strict):
    live = _session_with_a_place(strict, "live")
    silent = _raw(strict, hello=False, timeout_s=CLOSE_GUARD_S)
    half_hello = _raw(strict, hello=False, timeout_s=CLOSE_GUARD_S)
    half_hello.send(encode(Hello(version=PROTOCOL_VERSION, client="slow"))[:-1])
    half_frame = _raw(strict, timeout_s=CLOSE_GUARD_S)
    frame = encode(Stats(request_id=9))
    half_frame.send(frame[: len(frame) // 2])
    idle = _raw(strict)
    try:
        assert "no Hello within 1 s" in _closing_notice(silent).message
        assert "no Hello within 1 s" in _closing_notice(half_hello).message
        assert "did not arrive whole within 2 s" in _closing_notice(half_frame).message
        assert live.append("live", 1, 3, tokens=[4]).length == 4  # the live session is served throughout
        time.sleep(3.0)  # longer than either deadline: an idle connection between frames is not closed
        idle.send(encode(Stats(request_id=5)))
        reply = idle.read()
        assert isinstance(reply, StatsReply) and reply.request_id == 5
        assert "Traceback" not in strict.log()
    finally:
        for raw in (silent, half_hello, half_frame, idle):
            raw.close()
        live.close()


# ---- issue 17 item 6: the bound on request bytes buffered across all connections ---------------------


def _push(socks: list[socket.socket], data: bytes, whole: int, quiet_s: float = 3.0) -> list[int]:
    """Send `data` on every socket, as far as each is read, and return the bytes sent on each: until `whole`
    sockets have sent all of it (an event: the daemon read that much; the limit is a hang guard that says
    where the sending stands), then until the rest took no byte for quiet_s (the daemon stopped reading
    them: what they took by then is what the kernel's and the transport's buffers hold)."""
    view = memoryview(data)
    sent = [0] * len(socks)
    for sock in socks:
        sock.setblocking(False)
    started = last_progress = time.monotonic()
    next_note = started + 15.0

    def done() -> bool:
        return sum(count == len(data) for count in sent) >= whole and time.monotonic() - last_progress >= quiet_s

    while any(count < len(data) for count in sent) and not done():
        now = time.monotonic()
        assert now - started < HANG_GUARD_S, f"hang guard: {sum(sent) / MiB:.0f} MiB sent in {HANG_GUARD_S:.0f} s, {whole} frames never read whole: {sent}"
        if now >= next_note:
            next_note += 15.0
            print(f"sending: {sum(count == len(data) for count in sent)}/{whole} frames read whole, {sum(sent) / MiB:.0f} MiB sent", flush=True)
        pending = [sock for sock, count in zip(socks, sent) if count < len(data)]
        _, writable, _ = select.select([], pending, [], 0.2)
        for sock in writable:
            index = socks.index(sock)
            try:
                sent[index] += sock.send(view[sent[index] : sent[index] + 4 * MiB])
                last_progress = time.monotonic()
            except BlockingIOError:
                pass
    return sent


def test_twelve_unfinished_large_frames_hold_no_more_than_the_byte_bound(first_shard, socket_dir):
    """--max-buffered-bytes 64MiB and 30 MiB frames: two are read (their rest never comes), ten wait
    unread; the supervisor's RSS grows by less than the bound plus slack while a client is served. The
    bound is exercised: the frames offered are far more than it and the slack, the daemon read two of
    them whole (all but their last byte: as much of the bound as whole frames fill) and of each of the ten
    only what buffers hold."""
    bound, frame_bytes, slack = 64 * MiB, 30 * MiB, 32 * MiB
    daemon = DaemonProcess(
        first_shard.path, socket_dir / "bytes.sock", *ONE_PLACE, "--max-request-bytes", "32MiB", "--max-buffered-bytes", "64MiB", "--frame-timeout", "600",
    )
    raws: list[RawConnection] = []
    try:
        live = _session_with_a_place(daemon, "live")
        supervisor = psutil.Process(daemon.process.pid)
        rss_before = supervisor.memory_info().rss
        raws = [_raw(daemon) for _ in range(12)]
        body = b"\x00" * (frame_bytes - 1)  # one byte short: never a whole frame
        for raw in raws:
            raw.send(FRAME_HEADER.pack(frame_bytes))
        whole = bound // frame_bytes
        sent = _push([raw.sock for raw in raws], body, whole)
        growth = supervisor.memory_info().rss - rss_before
        print(f"sent {sum(sent) / MiB:.2f} MiB: {[round(count / MiB, 2) for count in sent]}; RSS +{growth / MiB:.1f} MiB")
        read_whole = [count for count in sent if count == len(body)]
        waiting = [count for count in sent if count < len(body)]
        assert len(raws) * len(body) > 3 * (bound + slack)  # a daemon without the bound would hold it all
        assert len(read_whole) == whole and len(waiting) == len(raws) - whole, [f"{count / MiB:.2f} MiB" for count in sent]
        assert max(waiting) < frame_bytes // 8, [f"{count / MiB:.2f} MiB" for count in waiting]  # buffers, never read
        assert growth < bound + slack, f"the supervisor's RSS grew {growth / MiB:.0f} MiB for {sum(sent) / MiB:.0f} MiB sent"
        assert live.append("live", 1, 3, tokens=[4]).length == 4  # served meanwhile
        assert live.stats().integrity == "ok"
        live.close()
    finally:
        for raw in raws:
            raw.close()
        daemon.stop()


# ---- issue 17 item 6: the connection limit ----------------------------------------------------------


def _refusal(daemon) -> ErrorReply:
    raw = _raw(daemon, hello=False)
    try:
        raw.send(encode(Hello(version=PROTOCOL_VERSION, client="one too many")))
        reply = raw.read()
        assert isinstance(reply, ErrorReply), f"connection past the limit was served: {reply!r}"
        assert raw.read() is None
        return reply
    finally:
        raw.close()


def test_one_connection_past_the_limit_gets_a_typed_refusal_and_live_sessions_go_on(first_shard, socket_dir):
    daemon = DaemonProcess(first_shard.path, socket_dir / "limit.sock", *ONE_PLACE, "--max-connections", "3")
    raws: list[RawConnection] = []
    try:
        live = _session_with_a_place(daemon, "live")
        raws = [_raw(daemon) for _ in range(2)]  # with live's: 3 open, the limit
        refused = _refusal(daemon)
        assert refused.code == "over_budget" and refused.message == "too many connections (3)" and refused.retry_after_s > 0
        with pytest.raises(KvpoolError) as again:
            Client(daemon.socket, direct=False)
        assert again.value.code == "over_budget"
        assert live.append("live", 1, 3, tokens=[4]).length == 4
        assert daemon.log().count("too many connections (3)") == 1  # one line for the burst
        raws.pop().close()
        wait_until(lambda: _served(daemon), "a connection to be served once one of the others closed")
        live.close()
    finally:
        for raw in raws:
            raw.close()
        daemon.stop()


def _served(daemon) -> bool:
    try:
        with daemon.client(direct=False) as client:
            return client.stats().integrity == "ok"
    except KvpoolError:
        return False


@contextlib.contextmanager
def children_with_open_files(limit: int, monkeypatch):
    """Processes started inside the block (a daemon) get RLIMIT_NOFILE = limit, as under prlimit."""
    popen = subprocess.Popen

    def limited(*args, **kwargs):
        return popen(*args, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)), **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr("kvpool.launcher.subprocess.Popen", limited)
        yield


def test_under_64_open_files_connections_are_refused_typed_and_accept_never_runs_out(first_shard, socket_dir, monkeypatch):
    with children_with_open_files(64, monkeypatch):
        daemon = DaemonProcess(first_shard.path, socket_dir / "nofile.sock", *ONE_PLACE)
    raws: list[RawConnection] = []
    try:
        assert psutil.Process(daemon.process.pid).rlimit(psutil.RLIMIT_NOFILE) == (64, 64)
        live = _session_with_a_place(daemon, "live")
        refused = None
        while refused is None and len(raws) < 200:
            raw = _raw(daemon, hello=False, timeout_s=CLOSE_GUARD_S)
            raws.append(raw)
            raw.send(encode(Hello(version=PROTOCOL_VERSION, client="many")))
            try:
                reply = raw.read()
            except TimeoutError:
                pytest.fail(f"connection {len(raws)} was neither served nor refused within {CLOSE_GUARD_S:.0f} s")
            if isinstance(reply, ErrorReply):
                refused = reply
        assert refused is not None and refused.code == "over_budget" and "too many connections" in refused.message
        for _ in range(30):  # a burst of refusals beyond the first
            assert _refusal(daemon).code == "over_budget"
        assert live.append("live", 1, 3, tokens=[4]).length == 4
        for raw in raws:
            raw.close()
        raws = []
        wait_until(lambda: _served(daemon), "a new client to be served once the others closed")
        log = daemon.log()
        assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]
        assert log.count("too many connections") == 1
        live.close()
    finally:
        for raw in raws:
            raw.close()
        daemon.stop()

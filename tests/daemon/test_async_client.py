"""kvpool.AsyncClient on real daemons: many requests in flight on one connection, matched by request id,
answered in the order they complete; cancel on a lane of its own, never behind the requests it is meant
to interrupt; a dead daemon fails every
request in flight. And the daemon's side: one connection's memory stays bounded when its client stops
reading. Waits are hang guards only (a stopped worker keeps a request in flight on any machine)."""

from __future__ import annotations

import asyncio
import os
import select
import signal

import numpy as np
import pytest

from kvpool import AsyncClient
from kvpool.client.client import ConnectionLost, KvpoolError
from kvpool.wire.protocol import PROTOCOL_VERSION, Append, Cancel, Done, ErrorReply, Hello, HelloReply, ShardDescription, decode_request, encode
from kvpool.daemon.transport.frames import MAX_IN_FLIGHT_PER_CONNECTION
from kvpool.wire.shape import ShardShape
from tests.conftest import EVEN_SPLIT
from tests.support.daemons import HANG_GUARD_S, DaemonProcess, exited, stopped, wait_until
from tests.support.daemons import RawConnection
from tests.support.daemons import admission_line_full

pytestmark = pytest.mark.timeout(3600)
N_CTX = 256
# Two compute slots: a session whose worker is stopped holds one, the others still compute.
OPTIONS = ("--threads", "2", "--n-ctx", str(N_CTX), "--max-sessions", "4")
CANCEL_GUARD_S = 60.0  # a cancel that is never read would wait for ever: this ends the wait


@pytest.fixture(scope="module")
def first_shard(shard_sets):
    return shard_sets[EVEN_SPLIT][0]


@pytest.fixture(scope="module")
def daemon(first_shard, socket_dir):
    daemon = DaemonProcess(first_shard.path, socket_dir / "async.sock", *OPTIONS)
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def clean(daemon):
    """The shared daemon with no sessions before and after the test."""
    yield daemon
    with daemon.client() as client:
        for row in client.stats().sessions:
            client.release(row.session_id, row.epoch)
        assert client.stats().sessions == []


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, HANG_GUARD_S))


async def poll(predicate, what: str):
    """await predicate() until it returns something true; the guard only stops a hang."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not (value := await predicate()):
            await asyncio.sleep(0.01)
    return value


def _worker_of(daemon, session_id: str) -> int:
    with daemon.client() as client:
        return next(row.worker_pid for row in client.stats().sessions if row.session_id == session_id)


def _partition(prompt: list[int], chunk: int) -> list[list[int]]:
    """A prompt in chunks, then four one-token decodes (fixed tokens: shard 0 gives hidden states)."""
    return [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)] + [[11], [12], [13], [14]]


def test_concurrent_sessions_on_one_connection_get_their_own_rows_bit_for_bit(clean, prompt_ids, tokenizer):
    prompts = [prompt_ids[0], prompt_ids[1], tokenizer.encode("List four fruits."), tokenizer.encode("Why is the sky blue?")]
    plans = [_partition(prompt, 5 + index) for index, prompt in enumerate(prompts)]
    expected = []
    with clean.client() as client:  # the synchronous client, one session after the other
        for index, plan in enumerate(plans):
            start, rows = 0, []
            for tokens in plan:
                rows.append(client.append(f"sync-{index}", 1, start, tokens=tokens).rows)
                start += len(tokens)
            client.release(f"sync-{index}", 1)
            expected.append(rows)

    async def session(client: AsyncClient, index: int) -> list[np.ndarray]:
        start, rows = 0, []
        for tokens in plans[index]:
            result = await client.append(f"async-{index}", 1, start, tokens=tokens)
            assert result.length == start + len(tokens)
            rows.append(result.rows)
            start += len(tokens)
            await client.stats()  # other kinds of request in between, on the same connection
        return rows

    async def main():
        async with AsyncClient(clean.socket) as client:
            results = await asyncio.gather(*(session(client, index) for index in range(len(plans))))
            connection = client._connection
            stats = await client.stats()
            assert client._connection is connection and not connection.closed  # one connection throughout
            return results, stats

    results, stats = run(main())
    for index, rows in enumerate(results):
        assert len(rows) == len(expected[index])
        for got, want in zip(rows, expected[index]):
            assert got.shape == want.shape and np.array_equal(got, want), f"session {index} got other rows"
    assert sorted(row.session_id for row in stats.sessions) == [f"async-{index}" for index in range(len(plans))]
    assert stats.integrity == "ok"


def test_a_short_decode_is_answered_while_a_long_prefill_on_the_same_connection_is_in_flight(clean, prompt_ids):
    long_prompt = (prompt_ids[1] * 8)[:200]
    with clean.client() as client:
        client.append("ref-long", 1, 0, tokens=long_prompt[:1])
        expected_long = client.append("ref-long", 1, 1, tokens=long_prompt[1:]).rows
        client.append("ref-short", 1, 0, tokens=prompt_ids[0][:6])
        expected_short = client.append("ref-short", 1, 6, tokens=[7]).rows
        client.release("ref-long", 1)
        client.release("ref-short", 1)

    async def main():
        async with AsyncClient(clean.socket) as client:
            await client.append("long", 1, 0, tokens=long_prompt[:1])
            await client.append("short", 1, 0, tokens=prompt_ids[0][:6])
            with stopped(_worker_of(clean, "long")):
                long = asyncio.create_task(client.append("long", 1, 1, tokens=long_prompt[1:]))
                await poll(lambda: _in_flight(client, "long"), "the long prefill to be in flight")
                short = await client.append("short", 1, 6, tokens=[7])  # answered first: the long one cannot finish
                assert not long.done()
            return (await long).rows, short.rows

    long_rows, short_rows = run(main())
    assert np.array_equal(long_rows, expected_long) and np.array_equal(short_rows, expected_short)


async def _in_flight(client: AsyncClient, session_id: str) -> bool:
    return any(row.session_id == session_id and row.in_flight for row in (await client.stats()).sessions)


def test_cancel_stops_the_append_in_flight_and_its_connection_goes_on(clean, prompt_ids):
    long_prompt = (prompt_ids[1] * 8)[:200]

    async def main():
        async with AsyncClient(clean.socket) as client:
            await client.append("cancel", 1, 0, tokens=long_prompt[:10])
            with stopped(_worker_of(clean, "cancel")):
                append = asyncio.create_task(client.append("cancel", 1, 10, tokens=long_prompt[10:]))

                async def cancel_reached_the_worker():
                    return (await client.cancel("cancel", 1)).detail == "cancel requested"

                await poll(cancel_reached_the_worker, "the long append to reach its worker")
                connection = client._connection
            with pytest.raises(KvpoolError) as cancelled:
                await append
            assert cancelled.value.code == "cancelled" and cancelled.value.length == 10
            assert client._connection is connection and not connection.closed
            # continuing after the rollback equals a run that was never cancelled
            continued = (await client.append("cancel", 1, 10, tokens=long_prompt[10:40])).rows
            fresh = (await client.append("fresh", 1, 0, tokens=long_prompt[:40])).rows
            return continued, fresh, await client.stats()

    continued, fresh, stats = run(main())
    assert np.array_equal(continued[-1], fresh[-1]) and stats.counters["cancels"] == 1


def test_a_daemon_killed_mid_request_fails_every_pending_request_and_the_next_call_reconnects(first_shard, socket_dir, prompt_ids):
    daemon = DaemonProcess(first_shard.path, socket_dir / "killed.sock", *OPTIONS)
    workers = daemon.worker_pids()
    try:

        async def main():
            client = await AsyncClient.connect(daemon.socket)
            for index in range(2):
                await client.append(f"s{index}", 1, 0, tokens=prompt_ids[index][:4])
            pids = [_worker_of(daemon, f"s{index}") for index in range(2)]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                pending = [asyncio.create_task(client.append(f"s{index}", 1, 4, tokens=[5, 6])) for index in range(2)]
                await poll(lambda: _all_in_flight(client), "both appends in flight")
                os.kill(daemon.process.pid, signal.SIGKILL)
                outcomes = await asyncio.gather(*pending, return_exceptions=True)

                async def refused():  # each call tries a new connection; once the daemon is gone, none opens
                    try:
                        await client.stats()
                    except ConnectionLost as error:
                        return "cannot connect" in str(error)
                    raise AssertionError("a killed daemon answered")

                await poll(refused, "connecting to the killed daemon to be refused")
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)  # they see their parent gone and exit
                await client.close()
            return outcomes

        outcomes = run(main())
        assert all(isinstance(outcome, ConnectionLost) for outcome in outcomes), outcomes
    finally:
        if daemon.process.poll() is None:
            daemon.process.kill()
        daemon.process.wait()
        wait_until(lambda: all(exited(pid) for pid in workers), "the killed daemon's workers to exit")
        daemon.socket.unlink(missing_ok=True)  # a killed daemon cannot remove its socket file
        daemon.stop()


async def _all_in_flight(client: AsyncClient) -> bool:
    rows = (await client.stats()).sessions
    return len(rows) == 2 and all(row.in_flight for row in rows)


def test_a_reply_to_an_id_nobody_waits_for_fails_the_connection_and_the_next_call_reconnects(socket_dir):
    path = socket_dir / "liar.sock"
    shard = ShardDescription(shape=ShardShape(layer_start=0, layer_stop=30, total_layers=30, n_embd=576, n_vocab=49152), model_path="x")
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        lie = len(connections) == 1
        while True:
            try:
                size = int.from_bytes(await reader.readexactly(4), "big")
                request = decode_request(await reader.readexactly(size))
            except asyncio.IncompleteReadError:
                return
            if isinstance(request, Hello):
                reply = HelloReply(version=PROTOCOL_VERSION, shard=shard, max_n_ctx=64, default_n_ctx=64, max_request_bytes=1024)
            else:
                reply = Done(length=request.length)
            reply.request_id = request.request_id + (100 if lie and not isinstance(request, Hello) else 0)
            writer.write(encode(reply))
            await writer.drain()

    async def main():
        server = await asyncio.start_unix_server(serve, path=str(path))
        try:
            async with AsyncClient(path) as client:
                results = await asyncio.gather(client.truncate("a", 1, 3), client.truncate("b", 1, 4), return_exceptions=True)
                again = await client.truncate("c", 1, 9)  # a new connection, answered honestly
                return results, again
        finally:
            server.close()
            for writer in connections:
                writer.close()

    results, again = run(main())
    assert all(isinstance(result, ConnectionLost) for result in results), results
    assert again == 9 and len(connections) == 2
    path.unlink(missing_ok=True)


def test_a_client_that_stops_reading_stops_the_daemon_reading_and_gets_every_reply_later(clean):
    """The daemon answers at most MAX_IN_FLIGHT_PER_CONNECTION requests ahead of what its client reads."""
    bad = encode(Append(session_id="x", epoch=1, start_pos=0, tokens=[]))  # bad_request, answered at once
    cap = 200_000  # frames; what a daemon reading without bound would take in
    raw = RawConnection(clean.socket)
    sent, unsent = 0, b""  # whole frames sent; the rest of a frame sent in part
    try:
        raw.sock.setblocking(False)
        while sent < cap:
            data = unsent or bad
            try:
                unsent = data[raw.sock.send(data) :]
            except BlockingIOError:
                # No room: wait for some. None within 2 s: the daemon has stopped reading (a daemon that
                # only reads slowly makes this pass too early, never fail).
                if not select.select([], [raw.sock], [], 2.0)[1]:
                    break
                continue
            sent += not unsent
        assert sent < cap, "the daemon kept reading requests whose replies nobody read"
        with clean.client() as other:  # the daemon is not stuck: another connection is served
            assert other.stats().integrity == "ok"
        raw.sock.setblocking(True)
        raw.sock.settimeout(HANG_GUARD_S)
        replies = [raw.read() for _ in range(sent)]
        if unsent:
            raw.sock.sendall(unsent)
            replies.append(raw.read())
        assert all(isinstance(reply, ErrorReply) and reply.code == "bad_request" for reply in replies)
        raw.sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            raw.sock.recv(1)  # exactly one reply per request
    finally:
        raw.close()
    assert MAX_IN_FLIGHT_PER_CONNECTION < sent


# ---- issue 17 item 3: cancel() reaches a connection full of requests ---------------------------------


WAITING = MAX_IN_FLIGHT_PER_CONNECTION - 1  # appends waiting for admission beside one prefill: the limit


@pytest.fixture
def one_place(first_shard, socket_dir):
    """One place, and an admission line of WAITING: a full line shows that all of them wait."""
    daemon = DaemonProcess(
        first_shard.path, socket_dir / "one-place.sock", "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1", "--admit-queue", str(WAITING),
    )
    try:
        yield daemon
    finally:
        daemon.stop()


def test_cancel_reaches_a_prefill_behind_appends_that_fill_the_connection(one_place, prompt_ids):
    """One AsyncClient: a prefill held in flight by its stopped worker, and appends waiting for the only
    place, as many as fill the daemon's in-flight limit for the connection. cancel() is answered "cancel
    requested" while they all still wait (they give up after kvpool.daemon.admission.admission.MAX_ADMIT_WAIT_S at the
    earliest), and the prefill ends cancelled."""
    long_prompt = (prompt_ids[1] * 8)[:200]
    waiting = WAITING

    async def main():
        async with AsyncClient(one_place.socket) as client:
            await client.append("long", 1, 0, tokens=long_prompt[:10])
            with one_place.client(direct=False) as observer:
                with stopped(_worker_of(one_place, "long")):
                    prefill = asyncio.create_task(client.append("long", 1, 10, tokens=long_prompt[10:]))
                    await asyncio.to_thread(wait_until, lambda: any(row.in_flight for row in observer.stats().sessions), "the prefill to be in flight")
                    appends = [asyncio.create_task(client.append(f"wait-{index}", 1, 0, tokens=[1], admit_timeout_s=HANG_GUARD_S)) for index in range(waiting)]
                    await asyncio.to_thread(wait_until, lambda: admission_line_full(observer), "the appends to wait for admission")
                    cancel = await client.cancel("long", 1)
                    still_waiting = sum(not append.done() for append in appends)
            with pytest.raises(KvpoolError) as cancelled:
                await prefill
            outcomes = await asyncio.gather(*appends, return_exceptions=True)
            return cancel, still_waiting, cancelled.value, outcomes

    cancel, still_waiting, cancelled, outcomes = run(main())
    assert still_waiting == waiting, "cancel() was answered only after requests ahead of it were"
    assert cancel.detail == "cancel requested"
    assert cancelled.code == "cancelled" and cancelled.length == 10
    assert all(not isinstance(outcome, BaseException) or isinstance(outcome, KvpoolError) for outcome in outcomes), outcomes


def test_cancel_is_sent_on_a_side_connection_opened_on_first_use(socket_dir):
    """A fake daemon that reads one request per connection and answers only a Cancel: the cancel of an
    append left unanswered on the main connection is answered (on a connection of its own)."""
    path = socket_dir / "one-request.sock"
    shard = ShardDescription(shape=ShardShape(layer_start=0, layer_stop=30, total_layers=30, n_embd=576, n_vocab=49152), model_path="x")
    writers, received = [], []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        for _ in range(2):  # the Hello, then one request
            size = int.from_bytes(await reader.readexactly(4), "big")
            request = decode_request(await reader.readexactly(size))
            received.append(type(request).__name__)
            if isinstance(request, Hello):
                reply = HelloReply(version=PROTOCOL_VERSION, shard=shard, max_n_ctx=64, default_n_ctx=64, max_request_bytes=1024)
            elif isinstance(request, Cancel):
                reply = Done(length=3, detail="cancel requested")
            else:
                await asyncio.Event().wait()  # an append that never completes; nothing more is read
            reply.request_id = request.request_id
            writer.write(encode(reply))
            await writer.drain()

    async def main():
        server = await asyncio.start_unix_server(serve, path=str(path))
        try:
            async with AsyncClient(path) as client:
                append = asyncio.create_task(client.append("s", 1, 3, tokens=[1]))
                while "Append" not in received:  # the main connection now reads nothing more
                    await asyncio.sleep(0.01)
                async with asyncio.timeout(CANCEL_GUARD_S):  # on the main connection it is never read
                    done = await client.cancel("s", 1)
                append.cancel()
                return done, len(writers)
        finally:
            server.close()
            for writer in writers:
                writer.close()

    done, connections = run(main())
    assert done.detail == "cancel requested" and connections == 2
    path.unlink(missing_ok=True)

"""kvpool.AsyncClient on daemons of fake workers (tests/support/fake_daemon.py) and on toy servers: many
requests in flight on one connection, matched by request id, answered in the order they complete; cancel on
a lane of its own, never behind the requests it is meant to interrupt; a reply to an id nobody waits for
fails the connection. And the daemon's side: one connection's memory stays bounded when its client stops
reading. A daemon SIGKILLed mid-request is tests/daemon/test_async_client.py's. Waits are hang guards only
(a stopped fake worker keeps a request in flight, as a SIGSTOPped one does on any machine)."""

from __future__ import annotations

import asyncio
import select

import numpy as np
import pytest

from kvpool import AsyncClient
from kvpool.client.client import ConnectionLost, KvpoolError
from kvpool.daemon.transport.frames import MAX_IN_FLIGHT_PER_CONNECTION
from kvpool.wire.protocol import PROTOCOL_VERSION, Append, Cancel, Done, ErrorReply, Hello, HelloReply, ShardDescription, decode_request, encode
from kvpool.wire.shape import ShardShape
from tests.support.daemons import HANG_GUARD_S, RawConnection, admission_line_full, poll, run_async, wait_until
from tests.support.fake_worker import expected_rows

N_CTX = 256
# Two compute slots: a session whose worker is stopped holds one, the others still compute.
OPTIONS = ("--threads", "2", "--n-ctx", str(N_CTX), "--max-sessions", "4")
CANCEL_GUARD_S = 60.0  # a cancel that is never read would wait for ever: this ends the wait
PROMPTS = [[(7 * index + offset) % 256 for index in range(length)] for offset, length in ((1, 23), (2, 37), (3, 11), (4, 17))]
LONG_PROMPT = [(13 * index + 5) % 256 for index in range(200)]


@pytest.fixture
def clean(serve, fake_shards):
    """A daemon of the first fake shard with no sessions before and after the test."""
    daemon = serve(fake_shards[0], *OPTIONS, name="async")
    yield daemon
    with daemon.client() as client:
        for row in client.stats().sessions:
            client.release(row.session_id, row.epoch)
        assert client.stats().sessions == []






def _partition(prompt: list[int], chunk: int) -> list[list[int]]:
    """A prompt in chunks, then four one-token decodes (fixed tokens: shard 0 gives hidden states)."""
    return [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)] + [[11], [12], [13], [14]]


def _rows(client, history: list[int]) -> np.ndarray:
    return expected_rows(client.hello.shard.shape, np.asarray(history, np.int32))


def test_concurrent_sessions_on_one_connection_get_their_own_rows_bit_for_bit(clean):
    plans = [_partition(prompt, 5 + index) for index, prompt in enumerate(PROMPTS)]
    expected = []
    with clean.client() as client:  # the synchronous client, one session after the other
        for index, plan in enumerate(plans):
            start, rows = 0, []
            for tokens in plan:
                rows.append(client.append(f"sync-{index}", 1, start, tokens=tokens).rows)
                start += len(tokens)
            client.release(f"sync-{index}", 1)
            expected.append(rows)
        assert all(np.array_equal(np.concatenate(rows), _rows(client, sum(plan, []))) for rows, plan in zip(expected, plans))

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

    results, stats = run_async(main())
    for index, rows in enumerate(results):
        assert len(rows) == len(expected[index])
        for got, want in zip(rows, expected[index]):
            assert got.shape == want.shape and np.array_equal(got, want), f"session {index} got other rows"
    assert sorted(row.session_id for row in stats.sessions) == [f"async-{index}" for index in range(len(plans))]
    assert stats.integrity == "ok"


async def _in_flight(client: AsyncClient, session_id: str) -> bool:
    return any(row.session_id == session_id and row.in_flight for row in (await client.stats()).sessions)


def test_a_short_decode_is_answered_while_a_long_prefill_on_the_same_connection_is_in_flight(clean):
    long_prompt, short_prompt = LONG_PROMPT, PROMPTS[0][:6]
    with clean.client() as client:
        client.append("ref-long", 1, 0, tokens=long_prompt[:1])
        expected_long = client.append("ref-long", 1, 1, tokens=long_prompt[1:]).rows
        client.append("ref-short", 1, 0, tokens=short_prompt)
        expected_short = client.append("ref-short", 1, 6, tokens=[7]).rows
        client.release("ref-long", 1)
        client.release("ref-short", 1)
        assert np.array_equal(expected_long, _rows(client, long_prompt)[1:]) and np.array_equal(expected_short, _rows(client, short_prompt + [7])[6:])

    async def main():
        async with AsyncClient(clean.socket) as client:
            await client.append("long", 1, 0, tokens=long_prompt[:1])
            await client.append("short", 1, 0, tokens=short_prompt)
            with clean.stopped("long"):
                long = asyncio.create_task(client.append("long", 1, 1, tokens=long_prompt[1:]))
                await poll(lambda: _in_flight(client, "long"), "the long prefill to be in flight")
                short = await client.append("short", 1, 6, tokens=[7])  # answered first: the long one cannot finish
                assert not long.done()
            return (await long).rows, short.rows

    long_rows, short_rows = run_async(main())
    assert np.array_equal(long_rows, expected_long) and np.array_equal(short_rows, expected_short)


def test_cancel_stops_the_append_in_flight_and_its_connection_goes_on(clean):
    long_prompt = LONG_PROMPT

    async def main():
        async with AsyncClient(clean.socket) as client:
            await client.append("cancel", 1, 0, tokens=long_prompt[:10])
            with clean.stopped("cancel"):
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

    continued, fresh, stats = run_async(main())
    assert np.array_equal(continued[-1], fresh[-1]) and stats.counters["cancels"] == 1


def test_a_reply_to_an_id_nobody_waits_for_fails_the_connection_and_the_next_call_reconnects(sockets):
    path = sockets / "liar.sock"
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

    results, again = run_async(main())
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
def one_place(serve, fake_shards):
    """One place, and an admission line of WAITING: a full line shows that all of them wait."""
    return serve(fake_shards[0], "--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1", "--admit-queue", str(WAITING), name="one-place")


def test_cancel_reaches_a_prefill_behind_appends_that_fill_the_connection(one_place):
    """One AsyncClient: a prefill held in flight by its stopped worker, and appends waiting for the only
    place, as many as fill the daemon's in-flight limit for the connection. cancel() is answered "cancel
    requested" while they all still wait (they give up after kvpool.daemon.admission.admission.MAX_ADMIT_WAIT_S at the
    earliest), and the prefill ends cancelled."""
    long_prompt = LONG_PROMPT
    waiting = WAITING

    async def main():
        async with AsyncClient(one_place.socket) as client:
            await client.append("long", 1, 0, tokens=long_prompt[:10])
            with one_place.client() as observer:
                with one_place.stopped("long"):
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

    cancel, still_waiting, cancelled, outcomes = run_async(main())
    assert still_waiting == waiting, "cancel() was answered only after requests ahead of it were"
    assert cancel.detail == "cancel requested"
    assert cancelled.code == "cancelled" and cancelled.length == 10
    assert all(not isinstance(outcome, BaseException) or isinstance(outcome, KvpoolError) for outcome in outcomes), outcomes


def test_cancel_is_sent_on_a_side_connection_opened_on_first_use(sockets):
    """A toy daemon that reads one request per connection and answers only a Cancel: the cancel of an
    append left unanswered on the main connection is answered (on a connection of its own)."""
    path = sockets / "one-request.sock"
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

    done, connections = run_async(main())
    assert done.detail == "cancel requested" and connections == 2
    path.unlink(missing_ok=True)

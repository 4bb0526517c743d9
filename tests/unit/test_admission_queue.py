"""The admission queue and residency on real books, without processes: first come first served, bounded by
the admit timeout and the line's limit, waiting for a protection to lapse rather than evicting, and every
over_budget carrying retry_after_s. The clock is the event loop's; waits are short and only bounded below
(plus a generous hang guard), never timed for speed."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from kvpool.daemon.admission.queue import SETTLING_WAIT_S, AdmissionQueue
from kvpool.daemon.admission.residency import MIN_RESIDENCY_FLOOR_S, RESIDENCY_ROUTE_STEPS, Residency, derived_min_residency_s
from kvpool.daemon.books.books import Books
from kvpool.daemon.books.spill import SpillStore
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import ErrorCode, ErrorReply, MissReason, decode_reply, encode
from kvpool.wire.shape import ShardShape

CHARGE = 100
HANG_GUARD_S = 30


class Daemon:
    """Books with room for one session (one worker), the line in front of them, and a lifecycle to wake it."""

    def __init__(self, min_residency_s: float = 0.0, limit: int = 8) -> None:
        self.books = Books(CHARGE, ["w0"])
        self.metrics = Metrics()
        self.lifecycle = WorkerLifecycle(self.books, None, self.metrics, threads=1)  # type: ignore[arg-type]
        self.queue = AdmissionQueue(self.books, lambda _w: True, self.lifecycle, self.metrics, limit=limit, residency=lambda: Residency(min_residency_s))
        self.admitted: list[str] = []

    async def admit(self, session_id: str, timeout_s: float, *, busy: bool = True, charge: int = CHARGE):
        async with self.queue.turn(time.monotonic() + timeout_s) as ticket:
            plan = await self.queue.plan(ticket, charge, 0, lambda: None)
            session, released = self.books.admit(plan, session_id=session_id, epoch=1, n_ctx=64, charge=charge, now=time.monotonic())
        for worker in released:
            self.books.give_back(worker)
        session.in_flight = 1 if busy else 0
        self.admitted.append(session_id)
        self.books.check_integrity()
        return session

    async def go_idle(self, session_id: str) -> None:
        session = self.books.table.get(session_id)
        session.in_flight = 0
        session.passed_on = False  # as kvpool.daemon.gate.Gate.leave
        session.last_used = time.monotonic()
        await self.lifecycle.notify_capacity()


def run(coroutine):
    async def guarded():
        return await asyncio.wait_for(coroutine, HANG_GUARD_S)

    return asyncio.run(guarded())


async def _settle(daemon: Daemon, waiting: int) -> None:
    while len(daemon.queue) != waiting:
        await asyncio.sleep(0.005)


def test_waiting_admissions_are_placed_first_come_first_served_and_late_ones_do_not_overtake():
    async def scenario():
        daemon = Daemon()
        await daemon.admit("holder", 0)
        waiters = []
        for name in ("a", "b", "c"):
            waiters.append(asyncio.create_task(daemon.admit(name, 10)))
            await _settle(daemon, len(waiters))
        # an admission that may not wait does not jump the line: over_budget at once, with a hint
        with pytest.raises(RequestFailed) as refused:
            await daemon.admit("impatient", 0)
        assert refused.value.code is ErrorCode.OVER_BUDGET and refused.value.retry_after_s > 0
        for holder in ("holder", "a", "b"):  # each one's going idle makes room for exactly the next in line
            await daemon.go_idle(holder)
            await _settle(daemon, len(daemon.queue) - 1)
        await asyncio.gather(*waiters)
        assert daemon.admitted == ["holder", "a", "b", "c"]
        assert daemon.metrics.snapshot()["admissions_queued"] == 3 and daemon.metrics.snapshot()["admission_wait_max_ms"] > 0

    run(scenario())


def test_a_full_line_and_an_expired_wait_answer_over_budget_with_retry_after_and_leave_the_line():
    async def scenario():
        daemon = Daemon(min_residency_s=0.05, limit=2)
        await daemon.admit("holder", 0)  # busy throughout: no room ever frees up
        waiting = [asyncio.create_task(daemon.admit(name, 10)) for name in ("a", "b")]
        await _settle(daemon, 2)
        with pytest.raises(RequestFailed) as full:
            await daemon.admit("c", 10)
        assert full.value.code is ErrorCode.OVER_BUDGET and full.value.retry_after_s >= 0.05
        assert "limit" in str(full.value)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert len(daemon.queue) == 0  # a cancelled wait leaves the line
        started = time.monotonic()
        with pytest.raises(RequestFailed) as expired:
            await daemon.admit("d", 0.2)
        assert time.monotonic() - started >= 0.2 and expired.value.retry_after_s >= 0.05
        assert len(daemon.queue) == 0 and daemon.admitted == ["holder"]
        daemon.books.check_integrity()

    run(scenario())


def test_a_recently_used_idle_session_is_waited_for_not_evicted_and_an_older_one_is_evicted_first():
    async def scenario():
        daemon = Daemon(min_residency_s=0.3)
        await daemon.admit("recent", 0)
        await daemon.go_idle("recent")  # idle, but used just now: protected for 0.3 s
        started = time.monotonic()
        await daemon.admit("newcomer", 0)  # admit_timeout_s 0: it still waits, for the protection only
        assert time.monotonic() - started >= 0.3 - 0.01
        assert daemon.books.table.miss_reason("recent", 1).value == "evicted"
        # room for two: the older idle session goes first, the protected one stays
        daemon.books = books = Books(2 * CHARGE, ["w0", "w1"])
        daemon.queue.books = books
        await daemon.admit("old", 0, busy=False)
        books.table.get("old").last_used = time.monotonic() - 1.0
        await daemon.admit("fresh", 0)
        await daemon.go_idle("fresh")
        await daemon.admit("third", 0)
        assert {s.session_id for s in books.table.sessions()} == {"fresh", "third"}

    run(scenario())


def test_a_worker_on_its_way_back_is_waited_for_rather_than_evicting_an_idle_session_for_one():
    async def scenario():
        daemon = Daemon(min_residency_s=5.0)
        daemon.books = books = Books(3 * CHARGE, ["w0", "w1"])
        daemon.queue.books = books
        old = await daemon.admit("old", 0, busy=False)
        old.last_used = time.monotonic() - 60  # long idle: evictable
        released = await daemon.admit("released", 0, busy=False)
        in_transit = books.forget(released, MissReason.RELEASED)  # its context being freed: bytes back at once
        newcomer = asyncio.create_task(daemon.admit("newcomer", 0))
        await asyncio.sleep(0.05)
        assert not newcomer.done()  # it waits for the worker, it does not evict "old" for one
        books.give_back(in_transit)
        await daemon.lifecycle.notify_capacity()
        session = await newcomer
        assert session.worker_name == in_transit and books.table.get("old") is old
        # a worker that does not come back within the residency: then an idle session is evicted for one
        forgotten = books.forget(books.table.get("newcomer"), MissReason.RELEASED)
        daemon.queue.residency = lambda: Residency(0.1)
        started = time.monotonic()
        await daemon.admit("later", 0)
        assert time.monotonic() - started >= 0.1 - 0.01 and books.table.get("old") is None
        books.give_back(forgotten)
        books.check_integrity()

    run(scenario())


def test_an_admission_waits_past_its_timeout_for_a_session_settling_only_where_its_end_makes_room_and_boundedly():
    """A session whose one request in flight is the daemon's own work after its reply (Session.settling: Gate.pass_on
    set passed_on) holds room an admission asking no wait is placed in once that work ends; not a session with a
    request of a client's behind that work, nor room that would not be enough; and never past SETTLING_WAIT_S (the
    residency here is shorter)."""

    async def scenario():
        daemon = Daemon()
        holder = await daemon.admit("holder", 0)
        holder.passed_on = True  # its reply is out, its capture holds it
        waiting = asyncio.create_task(daemon.admit("a", 0))
        await _settle(daemon, 1)
        await asyncio.sleep(0.05)
        assert not waiting.done()  # refused at once before: no idle session to evict
        await daemon.go_idle("holder")
        await waiting
        assert daemon.admitted == ["holder", "a"] and daemon.books.table.miss_reason("holder", 1).value == "evicted"
        # a client's request queued behind the daemon's work: not settling, refused at once as before
        queued = daemon.books.table.get("a")
        queued.passed_on, queued.in_flight = True, 2
        with pytest.raises(RequestFailed) as behind:
            await daemon.admit("b", 0)
        assert behind.value.code is ErrorCode.OVER_BUDGET
        # room that the settling session's end would not make (the rest held by a session busy with a request): refused at once
        daemon.books = books = Books(2 * CHARGE, ["w0", "w1"])
        daemon.queue.books = books
        await daemon.admit("busy", 0)
        (await daemon.admit("capturing", 0)).passed_on = True
        waits = []
        wait_for_capacity = daemon.lifecycle.wait_for_capacity

        async def counted(timeout_s):
            waits.append(timeout_s)
            return await wait_for_capacity(timeout_s)

        daemon.lifecycle.wait_for_capacity = counted
        with pytest.raises(RequestFailed) as short:
            await daemon.admit("big", 0, charge=2 * CHARGE)
        assert short.value.code is ErrorCode.OVER_BUDGET and waits == []
        # work that does not end: waited for SETTLING_WAIT_S past the deadline, then over_budget
        started = time.monotonic()
        with pytest.raises(RequestFailed) as bounded:
            await daemon.admit("c", 0)
        assert bounded.value.code is ErrorCode.OVER_BUDGET and time.monotonic() - started >= SETTLING_WAIT_S - 0.01
        books.check_integrity()
        # a park's save behind its answer that has turned its session cold, its worker on its way back: waited for too
        daemon.books = books = Books(CHARGE, ["w0"], spill=SpillStore(1 << 20))
        daemon.queue.books = books
        parking = await daemon.admit("parking", 0)
        parking.passed_on = True
        worker, dropped = books.park(parking, b"state")
        assert dropped == [] and books.state_of(worker) == "in transit" and parking.settling
        waiting = asyncio.create_task(daemon.admit("d", 0))
        await _settle(daemon, 1)
        await asyncio.sleep(0.05)
        assert not waiting.done()
        books.give_back(worker)
        await daemon.go_idle("parking")
        assert (await waiting).worker_name == worker
        books.check_integrity()

    run(scenario())


def test_the_default_residency_is_a_few_route_steps_of_the_measured_step_with_a_floor():
    middle = ShardShape(layer_start=10, layer_stop=20, total_layers=30, n_embd=576, n_vocab=32)
    assert derived_min_residency_s(0.001, middle) == MIN_RESIDENCY_FLOOR_S  # a fast step: the floor
    assert derived_min_residency_s(0.1, middle) == pytest.approx(RESIDENCY_ROUTE_STEPS * 3 * 0.1)
    half = ShardShape(layer_start=0, layer_stop=15, total_layers=30, n_embd=576, n_vocab=32)
    assert derived_min_residency_s(0.1, half) == pytest.approx(RESIDENCY_ROUTE_STEPS * 2 * 0.1)


class OldErrorReply(msgspec.Struct, tag="ErrorReply", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """ErrorReply as a peer from before retry_after_s decodes it."""

    request_id: int = 0
    code: str
    message: str
    length: int = 0
    reason: str | None = None
    session_id: str = ""
    epoch: int = 0


def test_retry_after_s_is_omitted_unless_set_so_a_reply_without_it_is_what_old_peers_decode():
    plain = encode(ErrorReply(code=ErrorCode.OVER_BUDGET, message="no room", request_id=3))[4:]
    assert msgspec.msgpack.decode(plain, type=OldErrorReply).message == "no room"  # an old peer decodes it
    assert decode_reply(plain).retry_after_s is None  # and so does a new one
    old = msgspec.msgpack.encode(OldErrorReply(code="over_budget", message="old daemon"))
    assert decode_reply(old).retry_after_s is None  # a new peer reads an old daemon's reply
    hinted = encode(ErrorReply(code=ErrorCode.OVER_BUDGET, message="no room", retry_after_s=0.25))[4:]
    assert decode_reply(hinted).retry_after_s == 0.25
    with pytest.raises(msgspec.ValidationError):  # known limit: a hinted over_budget is new to an old peer (unknown field)
        msgspec.msgpack.decode(hinted, type=OldErrorReply)

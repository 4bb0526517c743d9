"""Drain: the daemon stops without losing its sessions (SIGTERM, or Shutdown{drain: true}).

From the drain's start the daemon takes nothing new: every request but Cancel, Stats and Shutdown is
answered `draining` with retry_after_s, and so is an admission (or restore) still waiting for room; such a
reply means the request took no effect, and kvpool.client sends it again to the daemon that next serves the
socket. Requests read before the start finish within --drain-timeout; appends still computing then are
cancelled (their replies say `cancelled`). Then every hot session is parked into the spill store and, with a
disk tier, every parked state is written to disk, so the states outlast the process (one that fits nowhere,
or whose write fails, is dropped with its session and counted; the store leaves no partial file). The books
balance at the end. A second signal (kvpool.daemon.supervisor) ends the drain where it stands: what was
on disk by then (written by the drain, or before it) stays, as it would after a crash.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

from kvpool.daemon.books.sessions import Session
from kvpool.daemon.books.spill import DISK
from kvpool.daemon.service import KvService
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import Cancel, ErrorCode, Request, Shutdown, Stats

TAKEN_WHILE_DRAINING = (Cancel, Stats, Shutdown)  # they change no session: answered during a drain too
RETRY_AFTER_S = 0.5  # a draining reply's hint: when a successor may be there
CANCEL_EVERY_S = 0.05  # past the timeout, appends still computing are aborted again this often
CANCEL_GUARD_S = 10.0  # aborted appends that have not ended by then are left to the teardown
PARK_TRIES = 3  # a session found busy (housekeeping, a late direct append) is tried again this often


@dataclasses.dataclass(frozen=True, slots=True)
class DrainOutcome:
    parked: int  # sessions whose state survives: on disk with a disk tier, else in memory (gone with the process)
    dropped: collections.Counter[str]  # sessions lost, by why
    cancelled: int  # appends still computing at the timeout, cancelled
    seconds: float
    on_disk: bool
    integrity: str

    def line(self) -> str:
        where = "on disk" if self.on_disk else "in memory only (no --spill-dir: they end with the process)"
        why = ", ".join(f"{count} {reason}" for reason, count in sorted(self.dropped.items()))
        return (
            f"drain done: parked {self.parked} sessions {where}, dropped {sum(self.dropped.values())}"
            + (f" ({why})" if why else "") + f", cancelled {self.cancelled} appends past the timeout, "
            f"{self.seconds:.2f} s; books: {self.integrity}"
        )


class Drain:
    def __init__(self, service: KvService, timeout_s: float, announce: Callable[[str], None]) -> None:
        self.service = service
        self.timeout_s = timeout_s
        self._announce = announce
        self.active = False
        self.done = False  # the drain ended (the teardown follows)
        self._in_flight = 0  # requests taken (read before the drain started) and not yet answered
        self._settled = asyncio.Event()  # set while nothing is in flight
        self._settled.set()
        self._stop_now = asyncio.Event()  # a second signal: end the drain where it stands

    # ---- what is taken ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def taking(self, request: Request) -> Iterator[None]:
        """Around the handling of one request: refused `draining` once the drain started, else counted in
        flight until answered."""
        if isinstance(request, TAKEN_WHILE_DRAINING):
            yield
            return
        self.refuse_new()
        self._in_flight += 1
        self._settled.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._settled.set()

    def refuse_new(self) -> None:
        """Raises `draining` once the drain started (checked again by admissions after each wait)."""
        if self.active:
            raise RequestFailed(ErrorCode.DRAINING, "the daemon is draining: send the request again to the daemon that takes over this socket", retry_after_s=RETRY_AFTER_S)

    def stop_now(self) -> None:
        self._stop_now.set()

    @property
    def interrupted(self) -> bool:
        return self._stop_now.is_set()

    # ---- the drain --------------------------------------------------------------------------------------

    async def run(self) -> DrainOutcome:
        service = self.service
        started = time.monotonic()
        self.active = True
        sessions = service.books.table.sessions()
        hot = sum(session.hot for session in sessions)
        self._announce(
            f"drain started: {hot} hot and {len(sessions) - hot} parked sessions, {self._in_flight} requests in flight, "
            f"timeout {self.timeout_s:g} s; new requests are answered draining"
        )
        service.metrics.count("drains")
        service.lifecycle.spawn(service.lifecycle.notify_capacity())  # admissions waiting for room look again: draining
        cancelled = 0
        if not await self._until(self._quiet, self.timeout_s):
            cancelled = await self._cancel_in_flight()
        dropped: collections.Counter[str] = collections.Counter()
        if not self.interrupted:
            await self._park_hot(dropped)
        if not self.interrupted:
            self._persist(dropped)
        outcome = self._outcome(dropped, cancelled, time.monotonic() - started)
        service.metrics.count("drain_parked", outcome.parked)
        service.metrics.count("drain_dropped", sum(dropped.values()))
        self.done = True
        return outcome

    def _quiet(self) -> bool:
        """Nothing taken is unanswered, no append computes on a direct channel and no session is still in use
        past its request's answer (a park answered before its save holds the session until the save is done:
        kvpool.daemon.warm; an append's prefix capture after its reply: kvpool.daemon.prefix; housekeeping's own
        parks and copies too)."""
        channels = self.service.channels
        return self._settled.is_set() and not any(session.in_flight or channels.busy(session) for session in self.service.books.table.sessions())

    async def _until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Waits for `condition` (polled: direct appends end in the workers) up to `timeout_s`; False if
        it did not hold by then, or a second signal came."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0 or self.interrupted:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, CANCEL_EVERY_S)):
                    await self._stop_now.wait()
        return True

    async def _cancel_in_flight(self) -> int:
        """Abort every append still computing, again until they have all ended (as a Cancel request does:
        the session rolls back to its length before that append, and the reply says cancelled)."""
        computing = self._computing()
        self._announce(f"drain: {self._in_flight} requests still in flight after {self.timeout_s:g} s: cancelling {len(computing)} appends")
        deadline = time.monotonic() + CANCEL_GUARD_S
        while not self._quiet() and time.monotonic() < deadline and not self.interrupted:
            for session in self._computing():
                self.service.pool.get(session.worker_name).set_abort(True)
            await self._until(self._quiet, CANCEL_EVERY_S)
        return len(computing)

    def _computing(self) -> list[Session]:
        return [
            session for session in self.service.books.table.sessions()
            if session.hot and (session.appending or self.service.channels.busy(session))
        ]

    async def _park_hot(self, dropped: collections.Counter[str]) -> None:
        """Every hot session parked (its direct channel revoked first); without a warm tier they are
        counted as dropped, and the teardown ends them."""
        service = self.service
        if not service.books.spill.enabled:
            hot = [session for session in service.books.table.sessions() if session.hot]
            if hot:
                dropped["not parked: the warm tier is off (--spill-budget 0)"] += len(hot)
            return
        before = {session.key for session in service.books.table.sessions()}
        for _ in range(PARK_TRIES):
            for session in [session for session in service.books.table.sessions() if session.hot]:
                if self.interrupted:
                    return
                await service.parking.park(session, keep=False)
            if not any(session.hot for session in service.books.table.sessions()):
                break
            await asyncio.sleep(CANCEL_EVERY_S)
        still_hot = [session for session in service.books.table.sessions() if session.hot]
        if still_hot:
            dropped["not parked: still busy"] += len(still_hot)
        self._count_gone(before, dropped)

    def _persist(self, dropped: collections.Counter[str]) -> None:
        """With a disk tier, every parked state still in memory is written to disk (oldest first)."""
        books = self.service.books
        if books.spill.disk_dir is None:
            return
        failures = books.spill.disk_failures
        gone = books.persist_parked()
        failed = min(len(gone), books.spill.disk_failures - failures)
        if failed:
            dropped["dropped: their disk write failed"] += failed
        if len(gone) - failed:
            dropped["dropped: no room in --spill-disk-budget"] += len(gone) - failed
        self.service.metrics.count("spill_drops", len(gone))

    def _count_gone(self, before: set[tuple[str, int]], dropped: collections.Counter[str]) -> None:
        """Sessions live before parking and gone after it, by the reason the table remembers."""
        table = self.service.books.table
        live = {session.key for session in table.sessions()}
        for session_id, epoch in before - live:
            dropped[f"dropped while parking: {table.miss_reason(session_id, epoch)}"] += 1

    def _outcome(self, dropped: collections.Counter[str], cancelled: int, seconds: float) -> DrainOutcome:
        service = self.service
        spill = service.books.spill
        on_disk = spill.disk_dir is not None
        parked = [
            session for session in service.books.table.sessions()
            if not session.hot and (not on_disk or spill.tier_of(session.key) == DISK)
        ]
        try:
            service.check_integrity()
            integrity = "ok"
        except Exception as error:  # noqa: BLE001 - reported, the stop goes on
            integrity = f"FAILED: {error}"
        return DrainOutcome(len(parked), dropped, cancelled, seconds, on_disk, integrity)

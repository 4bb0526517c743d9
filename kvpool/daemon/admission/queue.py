"""The admission queue: admissions wait for room first come, first served.

Every admission joins the line (`turn`, held while it takes the room); only the first in line is handed a
plan to take room (`plan`: evict or park, reserve), so a later arrival never overtakes an earlier one,
whatever the timing of its wake-ups. An admission waits:

- until its deadline (the request's `admit_timeout_s`, at most kvpool.daemon.admission.admission.MAX_ADMIT_WAIT_S) for
  room: for a session to end, to go idle, or for a worker to come back; then over_budget;
- when first in line and only protected sessions could make room (kvpool.daemon.admission.residency), until the first
  protection lapses (at most the minimum residency), even past its admit timeout: that wait is bounded;
- when first in line with no room while sessions are busy only with the daemon's own work after their replies (a
  prefill's prefix capture, a park's save behind its answer: Session.settling) and that work's end would place it
  (their room, or the worker a park frees), for that end (which wakes the line), even past its admit timeout, by at
  most SETTLING_WAIT_S or the minimum residency if longer: the callers saw those sessions answered, so theirs is not
  room the daemon may refuse for at once; a capture's session, idle then, may be protected, and the protection's
  lapse is waited for as above;
- never in a full line: beyond `limit` waiting admissions the reply is over_budget at once.

Every over_budget reply of the line carries `retry_after_s`: the daemon's estimate of when room could be
there for the caller, (admissions ahead + 1) x the mean time a first-in-line admission waited for room,
never below the minimum residency (so a router's retries are bounded by one per residency) nor above
MAX_RETRY_AFTER_S. Waiting in line, admission k (0: first) is placed after at most k + 1 places free up,
so its wait is bounded by the time the k + 1 sessions holding the next places keep them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable

from kvpool.daemon.admission.residency import Residency
from kvpool.daemon.books.books import AdmissionPlan, Books, Usable
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.lifecycle import WorkerLifecycle
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import ErrorCode

MAX_RETRY_AFTER_S = 30.0
RECHECK_S = 1.0  # a waiting admission looks again at least this often, whatever woke it or not
SETTLING_WAIT_S = 1.0  # past its deadline, how long an admission may wait for sessions settling (or the residency, if longer)
HEAD_WAIT_WEIGHT = 0.25  # of each new sample in the running mean of first-in-line waits


@dataclasses.dataclass(slots=True, eq=False)
class Ticket:
    """One admission's place in line."""

    number: int
    joined: float
    deadline: float  # (monotonic) its admit_timeout_s runs out; a residency lapse may still be waited for past it
    first_since: float | None = None  # when it became first in line
    waited: bool = False  # it had to wait at least once
    placed: bool = False  # a plan was handed out (its waits are counted once)


class AdmissionQueue:
    def __init__(self, books: Books, usable: Usable, lifecycle: WorkerLifecycle, metrics: Metrics, *, limit: int, residency: Callable[[], Residency]) -> None:
        self.books = books
        self.usable = usable
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.limit = limit
        self.residency = residency  # read when needed: the default is known once calibration has run
        self._line: collections.deque[Ticket] = collections.deque()
        self._numbers = itertools.count()
        self._mean_first_wait_s: float | None = None

    def __len__(self) -> int:
        return len(self._line)

    @contextlib.asynccontextmanager
    async def turn(self, deadline: float) -> AsyncIterator[Ticket]:
        """A place in line for one admission, held until the block ends (take the room inside it); at once
        over_budget when the line is full."""
        now = time.monotonic()
        if len(self._line) >= self.limit:
            self.metrics.count("over_budget_rejects")
            raise RequestFailed(ErrorCode.OVER_BUDGET, f"{len(self._line)} admissions already wait for room here (the line's limit)", retry_after_s=self.retry_after_s(len(self._line)))
        ticket = Ticket(next(self._numbers), now, deadline)
        self._line.append(ticket)
        try:
            yield ticket
        finally:
            self._line.remove(ticket)
            if self._line:  # the next in line (or one behind a leaver) looks again
                self.lifecycle.spawn(self.lifecycle.notify_capacity())

    async def plan(self, ticket: Ticket, charge: int, n_ctx: int, before_each_try: Callable[[], None]) -> AdmissionPlan:
        """A plan that makes room for `charge` bytes and a worker for a context of `n_ctx` positions (a spare of
        that n_ctx first: kvpool.daemon.books.books.Books.plan_admission), once `ticket` is first in line; over_budget
        (with retry_after_s) when its wait runs out. before_each_try() may raise to end the wait. Carry the
        plan out before the next await (its victims may be used again otherwise); ask again as often as needed."""
        while True:
            before_each_try()
            now = time.monotonic()
            wake_at = ticket.deadline
            if self._line[0] is ticket:
                plan, lapse = self._try(ticket, charge, n_ctx, now)
                if plan is not None:
                    self._placed(ticket, now)
                    return plan
                if lapse is not None:
                    wake_at = max(ticket.deadline, lapse)
            if now >= wake_at:
                self.metrics.count("over_budget_rejects")
                raise RequestFailed(ErrorCode.OVER_BUDGET, self._refusal(charge), retry_after_s=self.retry_after_s(self._ahead_of(ticket)))
            ticket.waited = True
            await self.lifecycle.wait_for_capacity(min(wake_at - now, RECHECK_S))

    def _try(self, ticket: Ticket, charge: int, n_ctx: int, now: float) -> tuple[AdmissionPlan | None, float | None]:
        """The plan if room can be made now; else until when to wait for a better one (None: waiting
        would not help): a protection that lapses, if evicting a protected session would have made room; the
        end of the settling sessions' work, if that would make room where no idle session could (_settling_makes_room);
        a worker on its way back (its context being freed) when the bytes are there and only a worker is
        missing, rather than evicting for it (for at most the residency, from when the ticket came first)."""
        if ticket.first_since is None:
            ticket.first_since = now
        residency = self.residency()
        plan = self.books.plan_admission(charge, self.usable, n_ctx=n_ctx, protected_after=residency.protected_after(now))
        if plan is not None and plan.victims and now < ticket.first_since + residency.min_s and self._worker_on_its_way(charge):
            return None, ticket.first_since + residency.min_s  # the worker's return wakes the line (capacity)
        if plan is not None:
            return plan, None
        if self.books.plan_admission(charge, self.usable, n_ctx=n_ctx) is None:
            if self._settling_makes_room(charge, n_ctx):  # look again then, or once the work ends (it wakes the line)
                return None, min(now + RECHECK_S, ticket.deadline + max(SETTLING_WAIT_S, residency.min_s))
            return None, None
        return None, residency.next_lapse(self.books.table.least_recently_used_idle(), now)

    def _settling_makes_room(self, charge: int, n_ctx: int) -> bool:
        """Whether room for `charge` would be there once the settling sessions' work ends: a plan with the hot ones
        idle (evictable), or, for one a park has turned cold, the bytes already free and a worker on its way back."""
        settling = self.books.table.settling()
        if not settling:
            return False
        if self.books.plan_admission(charge, self.usable, n_ctx=n_ctx, settling=True) is not None:
            return True
        return any(not session.hot for session in settling) and self._worker_on_its_way(charge)

    def _worker_on_its_way(self, charge: int) -> bool:
        return self.books.room >= charge and any(self.books.state_of(worker) == "in transit" for worker in self.books.workers())

    def _placed(self, ticket: Ticket, now: float) -> None:
        if not ticket.waited or ticket.placed:
            return
        ticket.placed = True
        self.metrics.count("admissions_queued")
        self.metrics.note_max("admission_wait_max_ms", round((now - ticket.joined) * 1000))
        first_wait = now - (ticket.first_since if ticket.first_since is not None else now)
        mean = self._mean_first_wait_s
        self._mean_first_wait_s = first_wait if mean is None else mean + HEAD_WAIT_WEIGHT * (first_wait - mean)

    def _ahead_of(self, ticket: Ticket) -> int:
        return next(index for index, waiting in enumerate(self._line) if waiting is ticket)

    def retry_after_s(self, ahead: int) -> float:
        """When room could be there for an admission with `ahead` admissions before it in line."""
        floor = self.residency().min_s
        estimate = (ahead + 1) * (self._mean_first_wait_s or 0.0)
        return round(min(MAX_RETRY_AFTER_S, max(floor, estimate, 0.001)), 3)

    def _refusal(self, charge: int) -> str:
        free_workers = sum(map(self.usable, self.books.free_workers()))
        return (
            f"needs {charge} bytes and a worker; {self.books.room} bytes and {free_workers} workers free, "
            f"no idle session to evict (unprotected), {len(self._line) - 1} other admissions waiting"
        )

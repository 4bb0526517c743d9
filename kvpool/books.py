"""The daemon's books: the session table, the byte budget and which worker serves which session, kept as
one synchronous set (no awaits, no processes), so every decision about them is made in one step.

A worker is in exactly one state: free (no session, usable), bound (serving one live session), or in
transit (taken out of the books' hands: its context being freed, a calibration, a replacement).
check_integrity() raises IntegrityError unless: every worker is in one state; the bound workers are
exactly the live sessions' workers; the reserved bytes are exactly the live sessions' charges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpool.budget import ByteBudget
from kvpool.integrity import require
from kvpool.protocol import MissReason
from kvpool.sessions import Session, SessionTable

Usable = Callable[[str], bool]


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """Evict `victims` (idle, least recently used first), then serve the new session on `worker`:
    a free worker, or the first victim's worker taken over directly when `worker` is None."""

    victims: tuple[Session, ...]
    worker: str | None


class Books:
    def __init__(self, budget_bytes: int, workers: Iterable[str], *, on_change: Callable[[Books], None] | None = None) -> None:
        self._on_change = on_change or (lambda _books: None)  # after every admission and forget (gauges)
        self.table = SessionTable()
        self.budget = ByteBudget(budget_bytes)
        self._free: list[str] = list(workers)
        self._bound: dict[str, Session] = {}
        self._in_transit: set[str] = set()

    # ---- workers ---------------------------------------------------------------------------------

    def state_of(self, worker: str) -> str:
        if worker in self._bound:
            return "bound"
        return "in transit" if worker in self._in_transit else "free"

    def session_of(self, worker: str) -> Session | None:
        return self._bound.get(worker)

    def free_workers(self) -> list[str]:
        return list(self._free)

    def add_worker(self, worker: str) -> None:
        """A new worker joins, free."""
        require(worker not in self._free and worker not in self._bound and worker not in self._in_transit, f"{worker} is already known")
        self._free.append(worker)

    def remove_worker(self, worker: str) -> None:
        """An in-transit worker that is gone for good (stopped, replaced)."""
        require(worker in self._in_transit, f"{worker} is not in transit")
        self._in_transit.discard(worker)

    def take(self, usable: Usable, worker: str | None = None) -> str | None:
        """A free worker (the given one, or the most recently freed usable one) into transit; None if none."""
        candidates = [worker] if worker is not None else list(reversed(self._free))
        for name in candidates:
            if name in self._free and usable(name):
                self._free.remove(name)
                self._in_transit.add(name)
                return name
        return None

    def take_unusable(self, usable: Usable) -> list[str]:
        """Every free worker that can no longer be used (its process died) into transit, for replacement."""
        dead = [name for name in self._free if not usable(name)]
        for name in dead:
            self._free.remove(name)
            self._in_transit.add(name)
        return dead

    def give_back(self, worker: str) -> None:
        """An in-transit worker is free again."""
        require(worker in self._in_transit, f"{worker} is not in transit")
        self._in_transit.discard(worker)
        self._free.append(worker)

    # ---- sessions --------------------------------------------------------------------------------

    def plan_admission(self, charge: int, usable: Usable, *, protected_after: float = math.inf) -> AdmissionPlan | None:
        """Least recently used idle sessions whose eviction makes room for `charge` bytes and a worker;
        None when even evicting every idle session would not. Sessions last used after `protected_after`
        are never victims (residency, kvpool.residency)."""
        free = next((name for name in reversed(self._free) if usable(name)), None)
        available = self.budget.available
        victims: list[Session] = []
        for session in self.table.least_recently_used_idle():
            if available >= charge and (free is not None or victims):
                break
            if session.last_used > protected_after:
                break  # least recently used first: every later one is protected too
            victims.append(session)
            available += session.charged_bytes
        if available >= charge and (free is not None or victims):
            return AdmissionPlan(tuple(victims), free)
        return None

    def admit(self, plan: AdmissionPlan, *, session_id: str, epoch: int, n_ctx: int, charge: int, now: float) -> tuple[Session, list[str]]:
        """Carry out `plan` in one step: evict, reserve, bind. Returns the new session and the evicted
        sessions' workers now in transit (to be freed by the caller), the taken-over one excluded."""
        released: list[str] = [self.forget(victim, MissReason.EVICTED) for victim in plan.victims]
        if plan.worker is not None:
            worker = self.take(lambda _name: True, plan.worker)
            require(worker is not None, f"planned worker {plan.worker} is not free")
        else:
            worker = released.pop(0)
        self._in_transit.discard(worker)
        session = Session(session_id=session_id, epoch=epoch, n_ctx=n_ctx, charged_bytes=charge, worker_name=worker, last_used=now)
        self.budget.reserve(session.key, charge)
        self.table.add(session)
        self._bound[worker] = session
        self._on_change(self)
        return session, released

    def forget(self, session: Session, reason: MissReason) -> str:
        """Drop a live session: table (remembering why), budget, binding. Its worker is now in transit."""
        self.table.remove(session, reason)
        self.budget.release(session.key)
        if self._bound.get(session.worker_name) is session:
            del self._bound[session.worker_name]
            self._in_transit.add(session.worker_name)
        self._on_change(self)
        return session.worker_name

    # ---- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        live = self.table.sessions()
        self.budget.check_integrity(session.key for session in live)
        require(all(self.budget.charge_of(s.key) == s.charged_bytes for s in live), "a charge differs from its session's")
        require({s.worker_name for s in live} == set(self._bound), "bound workers != the live sessions' workers")
        require(all(self._bound[s.worker_name] is s for s in live), "a worker is bound to another session object")
        free = set(self._free)
        require(len(free) == len(self._free), "a worker is free twice")
        states = [free, set(self._bound), self._in_transit]
        for index, left in enumerate(states):
            for right in states[index + 1 :]:
                require(not left & right, f"workers in two states: {sorted(left & right)}")

    def workers(self) -> set[str]:
        return set(self._free) | set(self._bound) | self._in_transit

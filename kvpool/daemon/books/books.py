"""The daemon's books: the session table, the byte budget and which worker serves which session, kept as
one synchronous set (no awaits, no processes), so every decision about them is made in one step.

A live session is hot (bound to a worker, its charge reserved in the hot budget) or parked (no worker,
its saved state in the spill store, charged to that store's limits). A worker is in exactly one state:
free (no session, usable), bound (serving one hot session), or in transit (taken out of the books'
hands: its context being freed, a calibration, a replacement). A free worker may hold a spare: the
context of the session parked or released from it (process mode; the worker clears it before anyone but that
park's restore takes it), kept so that the next context of its n_ctx
is not created again; a spare keeps that session's charge, under its own owner in the budget, and is the
first room an admission takes (its worker frees it). check_integrity() raises IntegrityError unless: every
worker is in one state; the bound workers are exactly the hot sessions' workers; spares are on free
workers only; the reserved bytes are exactly the hot sessions' and the spares' charges; the stored blobs
are exactly the parked sessions'.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpool.daemon.books.budget import ByteBudget
from kvpool.daemon.books.integrity import require
from kvpool.daemon.books.prefixes import PrefixStore
from kvpool.daemon.books.sealing import StateSeal, monotonic_of
from kvpool.daemon.books.sessions import Session, SessionTable
from kvpool.daemon.books.spill import CorruptBlob, FoundFile, SpillStore
from kvpool.state.header import UNBOUND, StateIdentity
from kvpool.state.sequence import StateFormatError, check_cells
from kvpool.state.shared import SharedPayload, SharedState, close_payload, payload_view
from kvpool.wire.protocol import MissReason

Usable = Callable[[str], bool]


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """Free the spares of `spares` (free workers) and evict `victims` (idle, least recently used first),
    then serve the new session on `worker`: a free worker (its own spare, if any, becomes the session's
    context or is freed by the worker as it opens another), or the first victim's worker taken over
    directly when `worker` is None."""

    victims: tuple[Session, ...]
    worker: str | None
    spares: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Spare:
    """A free worker's spare context: the n_ctx it was opened with, the charge it keeps, and since when
    (time.monotonic(): a spare no admission takes within the TTL is freed, kvpool.daemon.housekeeping)."""

    n_ctx: int
    charge: int
    since: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class SpareOwner:
    """The budget's owner of a spare's charge (sessions own theirs by key)."""

    worker: str


class Books:
    def __init__(
        self, budget_bytes: int, workers: Iterable[str], *, spill: SpillStore | None = None, on_change: Callable[[Books], None] | None = None,
        fence_ids: int = 65536, identity: StateIdentity = UNBOUND, prefixes: PrefixStore | None = None,
    ) -> None:
        self._on_change = on_change or (lambda _books: None)  # after every change of a session (gauges)
        self.table = SessionTable(remembered_ids=fence_ids)
        self.budget = ByteBudget(budget_bytes)
        self.spill = spill if spill is not None else SpillStore(0)
        self.sealing = StateSeal(identity)  # every state in the store carries this daemon's identity
        self.prefixes = prefixes if prefixes is not None else PrefixStore(0, 1, identity=identity)
        self._restoring: dict[tuple[str, int], int] = {}  # parked sessions whose blob left the store to be restored: its size
        self._free: list[str] = list(workers)
        self._bound: dict[str, Session] = {}
        self._in_transit: set[str] = set()
        self._spares: dict[str, Spare] = {}

    # ---- workers ---------------------------------------------------------------------------------

    def state_of(self, worker: str) -> str:
        if worker in self._bound:
            return "bound"
        return "in transit" if worker in self._in_transit else "free"

    def session_of(self, worker: str) -> Session | None:
        return self._bound.get(worker)

    def free_workers(self) -> list[str]:
        return list(self._free)

    def spare_of(self, worker: str) -> Spare | None:
        return self._spares.get(worker)

    @property
    def spare_bytes(self) -> int:
        """The charges the spares keep."""
        return sum(spare.charge for spare in self._spares.values())

    @property
    def session_bytes(self) -> int:
        """The charges the hot sessions hold (the budget's reservations less the spares')."""
        return self.budget.reserved - self.spare_bytes

    @property
    def room(self) -> int:
        """The bytes an admission can have without evicting: what the budget has left and every spare's."""
        return self.budget.available + self.spare_bytes

    def _drop_spare(self, worker: str) -> None:
        """The worker's spare (if any) leaves the books and its charge the budget: its context is the next
        session's, or being freed."""
        if self._spares.pop(worker, None) is not None:
            self.budget.release(SpareOwner(worker))

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
        candidates = [worker] if worker is not None else sorted(reversed(self._free), key=lambda name: name in self._spares)
        for name in candidates:
            if name in self._free and usable(name):
                self._free.remove(name)
                self._in_transit.add(name)
                self._drop_spare(name)  # whoever takes it replaces or frees its contexts
                return name
        return None

    def take_unusable(self, usable: Usable) -> list[str]:
        """Every free worker that can no longer be used (its process died) into transit, for replacement."""
        dead = [name for name in self._free if not usable(name)]
        for name in dead:
            self._free.remove(name)
            self._in_transit.add(name)
            self._drop_spare(name)
        return dead

    def give_back(self, worker: str) -> None:
        """An in-transit worker is free again."""
        require(worker in self._in_transit, f"{worker} is not in transit")
        self._in_transit.discard(worker)
        self._free.append(worker)

    # ---- sessions --------------------------------------------------------------------------------

    def plan_admission(
        self, charge: int, usable: Usable, *, n_ctx: int = 0, protected_after: float = math.inf, settling: bool = False
    ) -> AdmissionPlan | None:
        """A free worker for a context of `n_ctx` (one whose spare has that n_ctx first, then one without a
        spare, most recently freed first), the spares and then the least recently used idle sessions whose
        eviction makes room for `charge` bytes and a worker; None when even evicting every idle session
        would not. Sessions last used after `protected_after` are never victims (residency,
        kvpool.daemon.admission.residency). With `settling`, the plan there would be once the hot sessions settling
        (busy only with the daemon's own work after a reply) are idle: to know whether waiting for them helps."""
        free = self._free_worker_for(n_ctx, usable)
        available = self.budget.available + (self._spares[free].charge if free in self._spares else 0)
        spares: list[str] = []
        for worker, spare in self._spares.items():
            if available >= charge:
                break
            if worker != free:
                spares.append(worker)
                available += spare.charge
        victims: list[Session] = []
        for session in self.table.least_recently_used_idle(settling=settling):
            if available >= charge and (free is not None or victims):
                break
            if session.last_used > protected_after:
                break  # least recently used first: every later one is protected too
            victims.append(session)
            available += session.charged_bytes
        if available >= charge and (free is not None or victims):
            return AdmissionPlan(tuple(victims), free, tuple(spares))
        return None

    def _free_worker_for(self, n_ctx: int, usable: Usable) -> str | None:
        usable_free = [name for name in reversed(self._free) if usable(name)]
        ranked = sorted(usable_free, key=lambda name: 0 if (spare := self._spares.get(name)) and spare.n_ctx == n_ctx else 2 if spare else 1)
        return ranked[0] if ranked else None

    def admit(self, plan: AdmissionPlan, *, session_id: str, epoch: int, n_ctx: int, charge: int, now: float) -> tuple[Session, list[str]]:
        """Carry out `plan` in one step: evict, reserve, bind. Returns the new session and the evicted
        sessions' workers now in transit (to be freed by the caller), the taken-over one excluded."""
        session = Session(session_id=session_id, epoch=epoch, n_ctx=n_ctx, charged_bytes=charge, worker_name="", last_used=now)
        self.table.add(session)
        return session, self._bind(plan, session, charge)

    def take_blob(self, session: Session) -> memoryview | SharedPayload:
        """A parked session's blob (a read-only view of its stored state's payload: no copy; a SharedPayload
        when the state is shared memory, the caller's to close) leaves the store for its restore (so making
        room for the restore never drops it); raises CorruptBlob (the blob is then gone too), also when its
        cells do not hold positions [0, its length) (kvpool.state.sequence.check_cells: llama.cpp would restore
        them as they are). put_back_blob or unpark follows."""
        require(not session.hot and session.key not in self._restoring, "only a parked session's blob is taken")
        blob: memoryview | SharedPayload | None = None
        try:
            blob = self.sealing.open_view(session, self.spill.read(session.key))
            try:
                check_cells(payload_view(blob), session.length)
            except StateFormatError as error:
                raise CorruptBlob(f"the saved state's cells are refused: {error}") from None
        except BaseException:
            close_payload(blob)
            raise
        finally:
            self.spill.discard(session.key, close=blob is None)
        self._restoring[session.key] = len(blob)
        return blob

    def read_blob(self, session: Session) -> bytes:
        """A parked session's state, checked and unwrapped; it stays stored. Raises CorruptBlob."""
        return self.sealing.open(session, self.spill.read(session.key))

    def reseal(self, session: Session) -> list[Session]:
        """A parked session's stored state is written again under its current length (a truncate cut it:
        what a later daemon adopts must say so); returns the sessions dropped for room. Raises CorruptBlob."""
        blob = self.read_blob(session)
        self.spill.discard(session.key)
        dropped = self._drop_spilled(self.spill.put(session.key, self.sealing.seal(session, blob)))
        self._on_change(self)
        return dropped

    def truncating(self, session: Session, length: int) -> None:
        """The session is about to keep only positions [0, length), hot or parked: its copy written behind
        (--persist-after) goes when it holds later positions, since those may be computed again from other
        tokens. The rule it keeps: no file on disk claims a position whose tokens differ from the session's
        now (a parked state's own file is resealed by `reseal`; a copy of length <= `length` stays a prefix)."""
        if length < session.persisted_length:
            self.spill.drop_behind(session.key)
            session.persisted_length = -1
        del session.digests[length // self.prefixes.block :]  # a block it no longer holds whole names nothing of it

    # ---- shared prefixes -------------------------------------------------------------------------

    def prefix_wanted(self, session: Session) -> bool:
        """The session names blocks (kvpool.wire.prefix) the prefix store does not hold yet."""
        return self.prefixes.enabled and bool(session.digests) and self.prefixes.holds(session.prefix_scope, session.digests) < len(session.digests)

    def offer_prefix(self, session: Session, payload: bytes, length: int) -> str:
        """The session's state (llama.cpp's bytes of `length` positions) offered to the prefix store as the
        blocks its digests name (kvpool.daemon.books.prefixes.PrefixStore.offer says what it returns)."""
        digests = session.digests[: length // self.prefixes.block]
        outcome = self.prefixes.offer(session.prefix_scope, digests, payload, length, session.n_ctx)
        self._on_change(self)
        return outcome

    def put_back_blob(self, session: Session, blob: memoryview | SharedPayload) -> list[Session]:
        """A restore that could not start: the blob goes back (newest; a shared one as it was sealed); returns
        the sessions dropped for room."""
        del self._restoring[session.key]
        stored = blob.state if isinstance(blob, SharedPayload) else self.sealing.seal(session, bytes(blob))
        dropped = self._drop_spilled(self.spill.put(session.key, stored))
        self._on_change(self)
        return dropped

    def unpark(self, plan: AdmissionPlan, session: Session, charge: int) -> list[str]:
        """A parked session whose blob was taken becomes hot on the plan's worker. Returns the evicted
        sessions' workers now in transit, as admit does."""
        require(not session.hot and self.table.get(session.session_id) is session, "only a live parked session is unparked")
        self._restoring.pop(session.key, None)
        return self._bind(plan, session, charge)

    def _bind(self, plan: AdmissionPlan, session: Session, charge: int) -> list[str]:
        released: list[str] = [worker for victim in plan.victims if (worker := self.forget(victim, MissReason.EVICTED))]
        for worker in plan.spares:
            require(worker in self._spares and worker in self._free, f"planned spare of {worker} is gone")
            self._free.remove(worker)
            self._in_transit.add(worker)
            self._drop_spare(worker)
            released.append(worker)
        if plan.worker is not None:
            worker = self.take(lambda _name: True, plan.worker)
            require(worker is not None, f"planned worker {plan.worker} is not free")
        else:
            worker = released.pop(0)
        self._in_transit.discard(worker)
        session.worker_name = worker
        session.charged_bytes = charge
        self.budget.reserve(session.key, charge)
        self._bound[worker] = session
        self._on_change(self)
        return released

    def park(self, session: Session, blob: bytes | SharedState, *, kept: bool = False) -> tuple[str | None, list[Session]]:
        """A hot session's saved state goes to the spill store and its charge back to the hot budget; its
        worker goes into transit (its context to be freed), or, `kept` (its worker kept the context:
        SaveState.keep), is free at once with that context as its spare, the charge moving to the spare.
        Returns the worker to free (None when kept) and the sessions whose blobs were dropped to make room
        (gone: evicted), this one included when its blob fits nowhere."""
        require(session.hot and self._bound.get(session.worker_name) is session, "only a bound hot session is parked")
        worker: str | None = session.worker_name
        del self._bound[worker]
        self.budget.release(session.key)
        if kept:
            self._keep_spare(worker, session)
            worker = None
        else:
            self._in_transit.add(worker)
        session.worker_name = ""
        dropped = self._drop_spilled(self.spill.put(session.key, self.sealing.seal(session, blob)))
        self._on_change(self)
        return worker, dropped

    def add_parked(self, session: Session, blob: bytes | SharedState) -> list[Session]:
        """A new live session that starts parked (a fork, a prefix admission: a SharedState then, sealed in
        place); returns the sessions dropped for room."""
        sealed = self.sealing.seal(session, blob)
        require(not session.hot and self.spill.fits(len(sealed)), "a parked session needs a blob the store can hold")
        self.table.add(session)
        dropped = self._drop_spilled(self.spill.put(session.key, sealed))
        self._on_change(self)
        return dropped

    def adopt(self, found: list[FoundFile], *, max_n_ctx: int) -> tuple[list[Session], collections.Counter]:
        """Files an earlier run left (kvpool.daemon.books.spill.scan_disk_dir) become parked sessions: the
        highest epoch per session id (then the latest saved), newest used first while the disk tier has
        room, each at its saved epoch, length and last use. Returns them and the count of the files left
        out by reason (those files are removed)."""
        left_out: collections.Counter = collections.Counter()
        best: dict[str, FoundFile] = {}
        for item in found:
            header = item.header
            if not 0 <= header.length <= header.n_ctx <= max_n_ctx:
                self._remove_left_out(item, left_out, f"n_ctx beyond --n-ctx {max_n_ctx}")
                continue
            kept = best.get(header.session_id)
            if kept is None or (header.epoch, header.saved_at) > (kept.header.epoch, kept.header.saved_at):
                if kept is not None:
                    self._remove_left_out(kept, left_out, "an older epoch of its session")
                best[header.session_id] = item
            else:
                self._remove_left_out(item, left_out, "an older epoch of its session")
        adopted = []
        for item in sorted(best.values(), key=lambda item: item.header.last_used, reverse=True):
            header = item.header
            session = Session(
                session_id=header.session_id, epoch=header.epoch, n_ctx=header.n_ctx, charged_bytes=0, worker_name="",
                length=header.length, last_used=monotonic_of(header.last_used),
            )
            if not self.spill.adopt(session.key, item):
                self._remove_left_out(item, left_out, "no room in --spill-disk-budget")
                continue
            self.table.add(session)
            adopted.append(session)
        self._on_change(self)
        return adopted, left_out

    @staticmethod
    def _remove_left_out(item: FoundFile, left_out: collections.Counter, reason: str) -> None:
        left_out[reason] += 1
        with contextlib.suppress(OSError):
            item.path.unlink()

    def persist_parked(self) -> list[Session]:
        """Every parked state held in memory goes to the disk tier (a drain); returns the sessions dropped
        because theirs fit nowhere or could not be written."""
        dropped = self._drop_spilled(self.spill.flush_to_disk())
        self._on_change(self)
        return dropped

    def _drop_spilled(self, keys: list) -> list[Session]:
        dropped = []
        for session_id, epoch in keys:
            session = self.table.get(session_id)
            if session is not None and session.epoch == epoch:
                self.table.remove(session, MissReason.EVICTED)
                self._restoring.pop(session.key, None)
                dropped.append(session)
        return dropped

    def _keep_spare(self, worker: str, session: Session) -> None:
        """`worker`, just unbound from `session` (whose charge the budget released), is free with that session's
        context as its spare, the same charge reserved for it."""
        self._free.append(worker)
        self._spares[worker] = Spare(session.n_ctx, session.charged_bytes, time.monotonic())
        self.budget.reserve(SpareOwner(worker), session.charged_bytes)

    def idle_spares(self, now: float, after_s: float) -> list[str]:
        """The free workers whose spare has been kept at least `after_s` seconds at `now` (nobody took it)."""
        return [worker for worker, spare in self._spares.items() if now - spare.since >= after_s]

    def forget(self, session: Session, reason: MissReason, *, kept: bool = False) -> str | None:
        """Drop a live session: table (remembering why), budget or stored blob, binding. Returns its
        worker, now in transit (None for a parked session), or, `kept` (its worker kept the context:
        CloseContext.keep), free at once with that context as its spare, the charge moving to the spare (None)."""
        self.table.remove(session, reason)
        self.budget.release(session.key)
        self.spill.discard(session.key)
        self.spill.drop_behind(session.key)
        self._restoring.pop(session.key, None)
        worker = None
        if session.hot and self._bound.get(session.worker_name) is session:
            worker = session.worker_name
            del self._bound[worker]
            if kept:
                self._keep_spare(worker, session)
                worker = None
            else:
                self._in_transit.add(worker)
        self._on_change(self)
        return worker

    # ---- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        everyone = self.table.sessions()
        live = [session for session in everyone if session.hot]
        parked = {session.key for session in everyone if not session.hot}
        require(set(self._restoring) <= parked, "a blob being restored belongs to no parked session")
        self.spill.check_integrity(parked - set(self._restoring), {s.key for s in live})
        require(set(self._spares) <= set(self._free), "a spare context on a worker that is not free")
        self.budget.check_integrity([session.key for session in live] + [SpareOwner(worker) for worker in self._spares])
        require(all(self.budget.charge_of(SpareOwner(w)) == spare.charge for w, spare in self._spares.items()), "a charge differs from its spare's")
        self.prefixes.check_integrity()
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

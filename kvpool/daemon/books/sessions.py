"""The session table: (route_session_id, route_epoch) -> live session, epoch fencing, miss reasons.

Pure bookkeeping on the supervisor's event loop; the clock is passed in so tests can drive it.

The fencing rule (README, "The contract"): for each session id the table knows the highest epoch seen,
for every live session and for up to `remembered_ids` others. When more ids than that have been seen, the
one whose highest epoch is lowest (least recently touched among equals) is forgotten and the table's
`epoch_floor` rises to that epoch: from then on an id the table does not know is stale below the floor.
So nothing is forgotten silently: a request that could be stale is refused (`stale_epoch`, the reply
names the floor), never admitted; a router starts new sessions at an epoch >= the floor.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import heapq

from kvpool.daemon.books.integrity import require
from kvpool.wire.protocol import MissReason


@dataclasses.dataclass(slots=True, eq=False)
class Session:
    session_id: str
    epoch: int
    n_ctx: int
    charged_bytes: int  # the hot budget's charge while hot; what a restore reserves again
    worker_name: str  # "" while parked (its state in the spill store)
    length: int = 0
    last_used: float = 0.0
    in_flight: int = 0
    # a request passed it on to the daemon's own work after its reply (kvpool.daemon.gate.Gate.pass_on: a prefill's prefix
    # capture, a park's save behind its answer), until that work leaves it
    passed_on: bool = False
    appending: bool = False
    channel: bool = False  # bound to its worker's direct channel (kvpool.daemon.pool.channels)
    # the worker's time of the last direct append whose length the books took, or the supervisor's when it last asked for a
    # binding (Channels.binding): a length in the control words is this binding's only when its time is later
    direct_since: float = 0.0
    persisted_length: int = -1  # the length of its copy written behind to disk (--persist-after); -1: none
    # its first len(digests) blocks' digests (kvpool.wire.prefix), chained in prefix_scope: what it offers the prefix store
    digests: list[bytes] = dataclasses.field(default_factory=list)
    prefix_scope: str = ""
    park_token: int = 0  # its last park's token (kvpool.daemon.admission.parking): the spare that park left is its own
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    @property
    def key(self) -> tuple[str, int]:
        return (self.session_id, self.epoch)

    @property
    def idle(self) -> bool:
        return self.in_flight == 0

    @property
    def hot(self) -> bool:
        return bool(self.worker_name)

    @property
    def settling(self) -> bool:
        """Its one request in flight is the daemon's own work after a reply (passed_on): once that ends it is idle (a
        capture's) or parked (a park's), and its end wakes the admissions waiting for room."""
        return self.passed_on and self.in_flight == 1


class EpochCheck(enum.Enum):
    CURRENT = "current"  # same epoch as the highest seen (or first sight)
    STALE = "stale"  # lower than the highest seen: reject, touch nothing
    NEWER = "newer"  # higher: the old epoch's state must be released first


class EpochMemory:
    """The highest epoch seen per session id, in bounded memory, and the floor below which an id it does
    not know is stale. Forgetting takes the lowest epoch first, so the floor rises as little as it can;
    an id whose highest epoch is at or below the floor needs no entry (the floor says as much)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the epoch memory needs room for at least one id")
        self.limit = limit
        self.floor = 0
        self._highest: dict[str, int] = {}
        self._by_epoch: dict[int, collections.OrderedDict[str, None]] = {}  # least recently touched first
        self._epochs: list[int] = []  # a heap of the epochs in _by_epoch (stale entries skipped)

    def __len__(self) -> int:
        return len(self._highest)

    def get(self, session_id: str) -> int | None:
        return self._highest.get(session_id)

    def see(self, session_id: str, epoch: int) -> None:
        known = self._highest.get(session_id)
        if known is not None and known >= epoch:
            self._by_epoch[known].move_to_end(session_id)
            return
        if known is not None:
            self._unfile(session_id, known)
        if epoch <= self.floor:
            return
        self._highest[session_id] = epoch
        ids = self._by_epoch.get(epoch)
        if ids is None:
            ids = self._by_epoch[epoch] = collections.OrderedDict()
            heapq.heappush(self._epochs, epoch)
        ids[session_id] = None
        while len(self._highest) > self.limit:
            self._forget_one()

    def _forget_one(self) -> None:
        while self._epochs[0] not in self._by_epoch:
            heapq.heappop(self._epochs)
        lowest = self._epochs[0]
        session_id, _ = self._by_epoch[lowest].popitem(last=False)
        self._unfile(session_id, lowest, popped=True)
        self.floor = max(self.floor, lowest)

    def _unfile(self, session_id: str, epoch: int, *, popped: bool = False) -> None:
        del self._highest[session_id]
        ids = self._by_epoch[epoch]
        if not popped:
            del ids[session_id]
        if not ids:
            del self._by_epoch[epoch]
            if len(self._epochs) > 2 * len(self._by_epoch) + 64:  # emptied epochs linger in the heap: bound them
                self._epochs = list(self._by_epoch)
                heapq.heapify(self._epochs)


class SessionTable:
    """Live sessions, the highest epoch seen per session id, and why a session is gone."""

    def __init__(self, *, remembered_ids: int = 65536) -> None:
        self._live: dict[str, Session] = {}
        self._epochs = EpochMemory(remembered_ids)
        # Bounded, least recently touched first out: a forgotten reason reads as `unknown` (still a miss).
        self._gone: collections.OrderedDict[tuple[str, int], MissReason] = collections.OrderedDict()
        self._remembered = remembered_ids

    def __len__(self) -> int:
        return len(self._live)

    def sessions(self) -> list[Session]:
        return list(self._live.values())

    def get(self, session_id: str) -> Session | None:
        return self._live.get(session_id)

    @property
    def epoch_floor(self) -> int:
        """Below this epoch, a session id the table does not know is stale."""
        return self._epochs.floor

    def check_epoch(self, session_id: str, epoch: int) -> EpochCheck:
        highest = self.highest_epoch(session_id)
        if highest is None:
            return EpochCheck.STALE if epoch < self._epochs.floor else EpochCheck.CURRENT
        if epoch == highest:
            return EpochCheck.CURRENT
        return EpochCheck.STALE if epoch < highest else EpochCheck.NEWER

    def fence_counts(self) -> dict[str, int]:
        """For status: the epoch floor and how many ids the fence remembers (of at most fence_ids)."""
        return {"epoch_floor": self._epochs.floor, "fenced_ids": len(self._epochs)}

    def is_current(self, session_id: str, epoch: int) -> bool:
        """Nothing of `epoch` may be created, served or exposed unless this holds (checked after every await)."""
        return self.check_epoch(session_id, epoch) is EpochCheck.CURRENT

    def see_epoch(self, session_id: str, epoch: int) -> None:
        """Record epoch as the highest seen for session_id (callers check it is not stale first)."""
        self._epochs.see(session_id, epoch)

    def highest_epoch(self, session_id: str) -> int | None:
        """The highest epoch known for the id (a live session's is never forgotten); None: unknown, see the floor."""
        live = self._live.get(session_id)
        remembered = self._epochs.get(session_id)
        if live is None:
            return remembered
        return live.epoch if remembered is None else max(remembered, live.epoch)

    def add(self, session: Session) -> None:
        require(session.session_id not in self._live, "one live epoch per session id")
        self._live[session.session_id] = session
        self._gone.pop(session.key, None)
        self.see_epoch(session.session_id, session.epoch)

    def remove(self, session: Session, reason: MissReason) -> None:
        """Forget a live session and remember why, for the cache_miss of its next request."""
        if self._live.get(session.session_id) is session:
            del self._live[session.session_id]
        self._remember_gone(session.key, reason)

    def _remember_gone(self, key: tuple[str, int], reason: MissReason) -> None:
        self._gone[key] = reason
        self._gone.move_to_end(key)
        while len(self._gone) > self._remembered:
            self._gone.popitem(last=False)

    def miss_reason(self, session_id: str, epoch: int) -> MissReason:
        return self._gone.get((session_id, epoch), MissReason.UNKNOWN)

    def note_new_epoch(self, session_id: str, epoch: int) -> None:
        """A request at a higher epoch released the old state: its own epoch has nothing yet."""
        self._remember_gone((session_id, epoch), MissReason.NEW_EPOCH)

    def least_recently_used_idle(self, *, settling: bool = False) -> list[Session]:
        """Idle hot sessions, least recently used first: the candidates to evict or park; with `settling`, the hot
        ones settling too (Session.settling: what they would be once the daemon's own work on them ends)."""
        return sorted((s for s in self._live.values() if s.hot and (s.idle or settling and s.settling)), key=lambda s: s.last_used)

    def settling(self) -> list[Session]:
        """The sessions whose one request in flight is the daemon's own work after a reply (Session.settling)."""
        return [s for s in self._live.values() if s.settling]

    def expired(self, now: float, ttl_s: float) -> list[Session]:
        return [s for s in self._live.values() if s.idle and now - s.last_used >= ttl_s]

"""The session table: (route_session_id, route_epoch) -> live session, epoch fencing, miss reasons.

Pure bookkeeping on the supervisor's event loop; the clock is passed in so tests can drive it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum

from kvpool.integrity import require
from kvpool.protocol import MissReason


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
    appending: bool = False
    channel: bool = False  # bound to its worker's direct channel (kvpool.channels)
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


class EpochCheck(enum.Enum):
    CURRENT = "current"  # same epoch as the highest seen (or first sight)
    STALE = "stale"  # lower than the highest seen: reject, touch nothing
    NEWER = "newer"  # higher: the old epoch's state must be released first


class SessionTable:
    """Live sessions, the highest epoch seen per session id, and why a session is gone."""

    def __init__(self, *, remembered_ids: int = 65536) -> None:
        self._live: dict[str, Session] = {}
        # Both bounded, least recently touched first out.
        self._highest_epoch: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._gone: collections.OrderedDict[tuple[str, int], MissReason] = collections.OrderedDict()
        self._remembered = remembered_ids

    def __len__(self) -> int:
        return len(self._live)

    def sessions(self) -> list[Session]:
        return list(self._live.values())

    def get(self, session_id: str) -> Session | None:
        return self._live.get(session_id)

    def check_epoch(self, session_id: str, epoch: int) -> EpochCheck:
        highest = self._highest_epoch.get(session_id)
        live = self._live.get(session_id)
        if live is not None:  # a live session's epoch is never forgotten, whatever the bound
            highest = live.epoch if highest is None else max(highest, live.epoch)
        if highest is None or epoch == highest:
            return EpochCheck.CURRENT
        return EpochCheck.STALE if epoch < highest else EpochCheck.NEWER

    def see_epoch(self, session_id: str, epoch: int) -> None:
        """Record epoch as the highest seen for session_id (callers check it is not stale first)."""
        self._highest_epoch[session_id] = max(epoch, self._highest_epoch.get(session_id, epoch))
        self._highest_epoch.move_to_end(session_id)
        while len(self._highest_epoch) > self._remembered:
            self._highest_epoch.popitem(last=False)

    def highest_epoch(self, session_id: str) -> int | None:
        live = self._live.get(session_id)
        remembered = self._highest_epoch.get(session_id)
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

    def least_recently_used_idle(self) -> list[Session]:
        """Idle hot sessions, least recently used first: the candidates to evict or park."""
        return sorted((s for s in self._live.values() if s.idle and s.hot), key=lambda s: s.last_used)

    def expired(self, now: float, ttl_s: float) -> list[Session]:
        return [s for s in self._live.values() if s.idle and now - s.last_used >= ttl_s]

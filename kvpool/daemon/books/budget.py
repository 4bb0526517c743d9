"""The byte budget: reservations per owner against one limit. Pure bookkeeping, no I/O."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator

from kvpool.daemon.books.integrity import require


class OverBudget(Exception):
    """A reservation does not fit in what is left of the budget."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"{requested} bytes requested, {available} available")
        self.requested = requested
        self.available = available


class ByteBudget:
    """Invariant: reserved == sum(charges) <= limit, and every charge is positive."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError("the budget must be positive")
        self.limit = limit_bytes
        self._charges: dict[Hashable, int] = {}
        self._reserved = 0

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def available(self) -> int:
        return self.limit - self._reserved

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.available

    def charge_of(self, owner: Hashable) -> int:
        return self._charges.get(owner, 0)

    def owners(self) -> list[Hashable]:
        return list(self._charges)

    def reserve(self, owner: Hashable, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError("a reservation must be positive")
        if owner in self._charges:
            raise ValueError(f"{owner!r} already holds a reservation")
        if nbytes > self.available:
            raise OverBudget(nbytes, self.available)
        self._charges[owner] = nbytes
        self._reserved += nbytes

    @contextlib.contextmanager
    def reserving(self, owner: Hashable, nbytes: int) -> Iterator[None]:
        """Reserve for the block; release again if the block raises (a failed admission leaves no trace)."""
        self.reserve(owner, nbytes)
        try:
            yield
        except BaseException:
            self.release(owner)
            raise

    def release(self, owner: Hashable) -> int:
        """Idempotent; returns the bytes given back."""
        nbytes = self._charges.pop(owner, 0)
        self._reserved -= nbytes
        return nbytes

    def check_integrity(self, live_owners: Iterable[Hashable] | None = None) -> None:
        require(self._reserved == sum(self._charges.values()), "reserved != sum of charges")
        require(0 <= self._reserved <= self.limit, f"reserved {self._reserved} outside [0, {self.limit}]")
        require(all(charge > 0 for charge in self._charges.values()), "non-positive charge")
        if live_owners is not None:
            live = set(live_owners)
            require(live == set(self._charges), f"charged {set(self._charges)} != live {live}")

"""How a session's step can fail: a contract violation (the run fails) or one daemon's error reply."""

from __future__ import annotations

import dataclasses

from kvpool.client import KvpoolError


class ContractViolation(Exception):
    """A daemon answered something the contract does not allow; the run fails."""


@dataclasses.dataclass(slots=True)
class StageFailed(Exception):
    """Daemon `stage` of the route answered an append or truncate with a typed error."""

    stage: int
    error: KvpoolError

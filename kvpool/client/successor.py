"""Waiting for the daemon that takes over a socket after a drain (kvpool.daemon.drain), for both clients.

A client that was told the daemon drained (a `draining` reply, or the farewell frame a drained daemon sends
every connection) sends a request that the old daemon took nothing of again, to whatever daemon then serves
the socket: it retries, with back-off, for at most `wait_s` (a hang guard: a daemon's start takes seconds to
minutes on a busy machine), and says so through `say` every SAY_EVERY_S seconds when one is given (nothing
by default). A request that may have been carried out (sent, and its reply lost) is never sent again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

DEFAULT_WAIT_S = 300.0
BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 2.0
SAY_EVERY_S = 15.0

Say = Callable[[str], None]


@dataclasses.dataclass(slots=True)
class SuccessorWait:
    """One request's wait for a successor daemon on `path`."""

    path: str
    wait_s: float
    say: Say | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    tries: int = 0
    said_at: float = dataclasses.field(default_factory=time.monotonic)

    def pause_s(self, failure: Exception, retry_after_s: float | None = None) -> float:
        """Seconds to wait before the next try: the daemon's hint, else exponential back-off. Once the wait
        is spent, `failure` is raised: the last `draining` reply's KvpoolError, or the ConnectionLost."""
        now = time.monotonic()
        left = self.started + self.wait_s - now
        if left <= 0:
            raise failure
        why = str(failure)
        backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** min(self.tries, 30))
        pause = retry_after_s if retry_after_s is not None and retry_after_s > 0 else backoff
        self.tries += 1
        if self.say is not None and now - self.said_at >= SAY_EVERY_S:
            self.said_at = now
            self.say(f"kvpool client: waiting for a daemon on {self.path} after a drain ({now - self.started:.0f} s of {self.wait_s:g} s): {why}")
        return min(left, max(0.0, min(pause, BACKOFF_MAX_S)))

"""What the drills of one session (kvpool.stress.cancels, faults, probes, schedule) take of it: a
SessionState, which kvpool.stress.driver.SessionDriver is. The drills never import the driver that
runs them, so the driver sits above them and nothing imports back up.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvpool.router.router import RoutedSession
from kvpool.stress.options import StressOptions
from kvpool.stress.plans import SessionSetup
from kvpool.stress.recording import Recorder
from kvpool.stress.restarts import ChainControl
from kvpool.stress.tap import TappedClient

StageHook = Callable[[int, int, int], None]  # (stage, start_pos, rows) just before an append goes to a daemon


class SessionState(Protocol):
    """One session as its drills see it. Between operations every daemon holds [0, length) of `tokens`
    under `epoch` (or lost it, and the next append replays); `logits` is the output for length - 1 when known."""

    setup: SessionSetup
    session_id: str
    options: StressOptions
    recorder: Recorder
    control: ChainControl | None
    clients: list[TappedClient]  # daemon k of the route is clients[k]
    session: RoutedSession
    rng: random.Random  # the session's seeded choices
    op_index: int  # the operation running now (sys.maxsize while the session finishes)
    tokens: list[int]
    logits: np.ndarray | None
    epoch: int
    stage: int  # the daemon an append is at right now, -1 between requests; read by the canceller thread
    stage_hook: StageHook | None  # run before each request of an append reaches a daemon
    cancelled_reply: tuple[int, int] | None  # (stage, length) of the last cancelled reply
    # What the drills count, reported per session:
    cancels_landed: int
    cancels_landed_on: Counter[int]
    cancels_completed: int
    late_cancels: int
    cancel_attempts_missed: int
    idle_results: list[str]

    @property
    def length(self) -> int: ...

    def route_append(self, tokens: Sequence[int]) -> np.ndarray: ...
    def took_effect(self, start: int, tokens: Sequence[int], last: np.ndarray, greedy: bool) -> None: ...
    def truncate_to(self, length: int) -> None: ...
    def start_over(self) -> None: ...

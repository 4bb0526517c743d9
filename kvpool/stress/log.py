"""What a session did (the log that is replayed alone), the reference chains, and replay_alone."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pathlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvpool.client.client import Client
from kvpool.local.chain import LocalChain
from kvpool.router.route import Route

# ---- what a session did: the log that is replayed alone ---------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedAppend:
    start: int
    tokens: tuple[int, ...]
    digest: str | None  # of the last output row (the logits) the daemons returned; None: not returned (a replay)
    greedy: bool  # tokens[0] was the argmax of the logits at position start - 1


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedTruncate:
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedReset:
    """The session's state is gone on every daemon (released, evicted, expired, lost, new epoch)."""


LogEntry = LoggedAppend | LoggedTruncate | LoggedReset


def replayed(tokens: Sequence[int], partition: Sequence[int]) -> list[LogEntry]:
    """What a replay from 0 made the daemons hold: a reset, then the appends of `partition` again (their
    outputs are not returned by the router: not compared)."""
    entries: list[LogEntry] = [LoggedReset()]
    position = 0
    for rows in partition:
        entries.append(LoggedAppend(position, tuple(tokens[position : position + rows]), None, False))
        position += rows
    return entries


def row_digest(row: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(row, dtype="<f4").tobytes()).hexdigest()[:32]


# ---- the reference: each session's log, alone ----------------------------------------------------------


class ReferenceChain(Protocol):
    def begin(self) -> None: ...
    def append(self, start: int, tokens: Sequence[int]) -> np.ndarray: ...
    def truncate(self, length: int) -> None: ...
    def end(self) -> None: ...


class DaemonReference:
    """A fresh chain of daemons with one worker each: every replayed session is alone on it."""

    def __init__(self, clients: Sequence[Client]) -> None:
        self.route = Route(clients)
        self._count = 0
        self._session_id = ""

    def begin(self) -> None:
        self._count += 1
        self._session_id = f"reference-{self._count}"

    def append(self, start: int, tokens: Sequence[int]) -> np.ndarray:
        return self.route.append(self._session_id, 1, start, tokens)[-1]

    def truncate(self, length: int) -> None:
        self.route.truncate(self._session_id, 1, length)

    def end(self) -> None:
        self.route.release(self._session_id, 1)


class LocalReference:
    """kvpool.local.chain.LocalChain in this process (same numerics as the daemons)."""

    def __init__(self, shard_paths: Sequence[pathlib.Path], n_ctx: int) -> None:
        self.chain = LocalChain(shard_paths)
        self.n_ctx = n_ctx
        self._session = None

    def begin(self) -> None:
        self._session = self.chain.new_session(self.n_ctx)

    def append(self, start: int, tokens: Sequence[int]) -> np.ndarray:
        assert self._session is not None
        return self._session.append(start, tokens)[-1]

    def truncate(self, length: int) -> None:
        assert self._session is not None
        self._session.truncate(length)

    def end(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def close(self) -> None:
        self.end()
        self.chain.close()


@dataclasses.dataclass(slots=True)
class ReplayOutcome:
    mismatches: list[str]
    checked_rows: int
    greedy_checked: int
    final_row: np.ndarray | None


def replay_alone(log: Sequence[LogEntry], chain: ReferenceChain, label: str) -> ReplayOutcome:
    """Run the log's operations alone; compare every output row digest (where the run had one) and every
    greedy token."""
    mismatches: list[str] = []
    argmax_at: dict[int, int] = {}  # session length -> argmax of the logits for the row before it
    final: np.ndarray | None = None
    checked = greedy = 0
    chain.begin()
    number = -1
    try:
        for number, entry in enumerate(log):
            match entry:
                case LoggedReset():
                    chain.end()
                    chain.begin()
                    argmax_at.clear()
                    final = None
                case LoggedTruncate(length=length):
                    chain.truncate(length)
                    argmax_at = {end: token for end, token in argmax_at.items() if end <= length}
                    final = None
                case LoggedAppend(start=start, tokens=tokens, digest=digest, greedy=is_greedy):
                    if is_greedy:
                        greedy += 1
                        alone = argmax_at.get(start)
                        if alone != tokens[0]:
                            mismatches.append(f"{label} op {number}: greedy token at position {start} was {tokens[0]}, alone {alone}")
                    row = np.array(chain.append(start, tokens), copy=True)
                    if digest is not None:
                        checked += 1
                        if row_digest(row) != digest:
                            mismatches.append(f"{label} op {number}: {len(tokens)} row(s) at position {start}: logits differ from the run alone")
                    argmax_at[start + len(tokens)] = int(np.argmax(row))
                    final = row
    except Exception as error:  # noqa: BLE001 - the reference itself failed: nothing to compare against
        mismatches.append(f"{label} op {number}: the run alone failed: {error!r}")
        final = None
    finally:
        with contextlib.suppress(Exception):
            chain.end()
    return ReplayOutcome(mismatches, checked, greedy, final)

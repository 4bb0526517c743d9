"""A chain of daemons for tests, and the greedy run every exactness test compares on it and in process.

One way to start a chain: `daemon_chain` (a context manager; `start_chain` and `stop_all` for a chain whose
life is not one block). Each daemon is a tests.support.daemons.DaemonProcess, started one after the other.
Not kvpool.launcher.start_daemons: it starts plain launcher.Daemon objects, whose stop() checks nothing,
and a DaemonProcess cannot adopt a started Daemon (it starts its own process), so a chain started there
would lose the checks every test relies on when a daemon stops (its workers gone, its socket removed).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvpool.local.generate import AppendTokens, greedy_tokens
from tests.support.daemons import DaemonProcess


def start_chain(
    shard_paths: Sequence[str | os.PathLike[str]],
    socket_dir: pathlib.Path,
    name: str,
    *options: str,
    per_daemon: Sequence[Sequence[str]] = (),
) -> list[DaemonProcess]:
    """One ready daemon per shard, first to last, on socket_dir/<name><index>.sock, each with `options` and
    then its own flags from `per_daemon` (one list per shard, or none). If one fails to start, those started
    are stopped before the failure is raised."""
    extra = [list(flags) for flags in per_daemon] or [[] for _ in shard_paths]
    if len(extra) != len(shard_paths):
        raise ValueError(f"{len(extra)} per-daemon option lists for {len(shard_paths)} shards")
    daemons: list[DaemonProcess] = []
    try:
        for index, (path, flags) in enumerate(zip(shard_paths, extra)):
            daemons.append(DaemonProcess(pathlib.Path(path), socket_dir / f"{name}{index}.sock", *options, *flags))
    except BaseException:
        stop_all(daemons)
        raise
    return daemons


def stop_all(daemons: Sequence[DaemonProcess]) -> None:
    """Stop every daemon, last first. Each is stopped even when an earlier one's stop checks fail; the first
    failure is raised once all are stopped."""
    failure: BaseException | None = None
    for daemon in reversed(daemons):
        try:
            daemon.stop()
        except BaseException as error:  # noqa: BLE001 - raised below, after the others are stopped
            failure = failure or error
    if failure is not None:
        raise failure


@contextlib.contextmanager
def daemon_chain(
    shard_paths: Sequence[str | os.PathLike[str]],
    socket_dir: pathlib.Path,
    name: str,
    *options: str,
    per_daemon: Sequence[Sequence[str]] = (),
) -> Iterator[list[DaemonProcess]]:
    """`start_chain` for the block; on leaving it, `stop_all` of the list as it is then (a test may have
    replaced a daemon in it by a restarted one)."""
    daemons = start_chain(shard_paths, socket_dir, name, *options, per_daemon=per_daemon)
    try:
        yield daemons
    finally:
        stop_all(daemons)


def release_all(daemons: Sequence[DaemonProcess]) -> None:
    """Release every session on every daemon; then each holds none, reserves no bytes, and its books balance."""
    for daemon in daemons:
        with daemon.client() as client:
            stats = client.stats()
            assert stats.integrity == "ok"
            for row in stats.sessions:
                client.release(row.session_id, row.epoch)
            stats = client.stats()
            assert stats.sessions == [] and stats.budget.reserved_bytes == 0 and stats.integrity == "ok"


def greedy_with_logits(
    append: AppendTokens,
    prompt: Sequence[int],
    count: int,
    *,
    prefill_chunk: int = 0,
    before_step: Callable[[int], None] | None = None,
) -> tuple[list[int], np.ndarray]:
    """`count` greedy tokens (kvpool.local.generate.greedy_tokens over `append`) and, stacked, the logits row
    each was chosen from: the last prefill chunk's, then each decode's but the last. before_step(n) runs
    before the n-th call of `append` (0: the first prefill chunk), chunks and decodes alike."""
    calls = 0
    chosen_from: list[np.ndarray] = []

    def recording_append(start: int, tokens: Sequence[int]) -> np.ndarray:
        nonlocal calls
        if before_step is not None:
            before_step(calls)
        calls += 1
        logits = append(start, tokens)
        if start + len(tokens) >= len(prompt):  # a token is chosen from the prompt's last row, and each decode's
            chosen_from.append(logits[-1].copy())
        return logits

    tokens = list(greedy_tokens(recording_append, prompt, count, prefill_chunk=prefill_chunk))
    return tokens, np.stack(chosen_from[: len(tokens)])


class SteppedGreedy:
    """A greedy session driven one step at a time (so several sessions, or a re-plan, can interleave): its
    prompt in appends of `chunk` tokens, then one token per step(); the logits row of every append is kept.
    `append(start, tokens)` is the session's (routed or in process)."""

    def __init__(self, append: AppendTokens, prompt: list[int], chunk: int) -> None:
        self._append = append
        self.length = 0
        self.rows: list[np.ndarray] = []
        self.tokens: list[int] = []
        for start in range(0, len(prompt), chunk):
            self._next(prompt[start : start + chunk])

    def step(self) -> None:
        token = int(np.argmax(self.rows[-1]))
        self.tokens.append(token)
        self._next([token])

    def _next(self, tokens: list[int]) -> None:
        logits = self._append(self.length, tokens)
        self.length += len(tokens)
        self.rows.append(logits[-1].copy())

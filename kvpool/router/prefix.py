"""Shared prefixes from the router's side (README, "Shared prefixes"): the block digests of a session's tokens
(kvpool.wire.prefix), sent with every append that completes a block so each daemon can offer the session's
state to its prefix store, and the reuse itself: look a prompt's blocks up on every daemon of the route, take
the longest length all of them hold (daemon k + 1 needs daemon k's rows for every position it does not hold)
and admit the session from that prefix on every daemon; the caller then computes only the rest. The lookup and the
admission ask every daemon at once (Client.ask_all): they cost the slowest daemon's time, not the sum. The first
append restores the session on the first daemon with its rows, while the later daemons restore it in a thread
(RestoringAhead) beside that compute."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import numpy as np

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.client.messages import admit_prefix_call, prefix_lookup_call, restore_call
from kvpool.router.route import Route
from kvpool.wire.prefix import chain_digests


class PrefixChain:
    """The digests of one session's whole blocks, kept between appends (recomputed from the first block that
    differs when the tokens change under it: a truncate, a release; from block 0 when the block changes: no
    chain mixes two blocks)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self._block = 0
        self._tokens = np.zeros(0, np.int64)  # the tokens the digests cover: len(_digests) * block
        self._digests: list[bytes] = []

    def digests(self, tokens: Sequence[int], block: int) -> list[bytes]:
        """The digests of every whole block of `tokens`."""
        if block != self._block:
            self._block, self._tokens, self._digests = block, np.zeros(0, np.int64), []
        ids = np.asarray(tokens, dtype=np.int64)
        common = min(len(ids), len(self._tokens))
        differs = np.flatnonzero(ids[:common] != self._tokens[:common])
        same_blocks = (int(differs[0]) if differs.size else common) // block
        del self._digests[same_blocks:]
        self._digests += chain_digests(ids, block, self.scope, start=same_blocks, parents=self._digests)
        self._tokens = ids[: len(self._digests) * block]
        return list(self._digests)

    def completed(self, before: Sequence[int], tokens: Sequence[int], block: int) -> list[bytes]:
        """The digests an append of `tokens` after `before` carries: of the blocks whose end it reaches."""
        start, stop = len(before), len(before) + len(tokens)
        if not block or stop // block == start // block:
            return []
        return self.digests([*before, *tokens], block)[start // block : stop // block]


def route_block(route: Route) -> int:
    """Tokens per block of the route's prefix stores: every daemon's, when they all keep one of one size;
    0 (no reuse) otherwise. Read from the clients' Hellos at every use: a daemon replaced on its socket (a drain's
    successor, a restart) may keep another block, which its client's Hello says from its reconnect on."""
    blocks = {getattr(getattr(client, "hello", None), "prefix_block", 0) for client in route.clients}  # a client without a Hello: none
    return blocks.pop() if len(blocks) == 1 else 0


def at_once(route: Route) -> bool:
    """Every client of the route is a kvpool Client, whose requests can go out to every daemon at once
    (Client.ask_all). A wrapper of one (kvpool.stress.tap.TappedClient, which sees each request to its daemon go
    out and come back) is asked one daemon at a time through its own methods, and no restore goes ahead of the
    first append: the session's appends restore it on each daemon, as they always can."""
    return all(isinstance(client, Client) for client in route.clients)


def held_everywhere(route: Route, scope: str, digests: list[bytes]) -> int:
    """The leading blocks of `digests` every daemon of the route holds (0 when one holds none or fails); every
    daemon asked at once where at_once."""
    if not digests:
        return 0
    if at_once(route):
        outcomes = _raise_unexpected(_ask_each(route.clients, lambda client: prefix_lookup_call(scope, digests)))
        return 0 if any(isinstance(outcome, Exception) for outcome in outcomes) else min(outcomes)
    held = len(digests)
    for client in route.clients:
        try:
            held = min(held, client.lookup_prefix(scope, digests[:held]))
        except (KvpoolError, ConnectionLost):
            return 0
        if not held:
            break
    return held


def admit_everywhere(route: Route, session_id: str, epoch: int, scope: str, digests: list[bytes], n_ctx: int) -> bool:
    """Admit (session_id, epoch) from the prefix `digests` names on every daemon of the route (at once where
    at_once: every daemon reads the prefix even when another refuses); False, with what was admitted released
    again, when one cannot (the prefix evicted since the lookup, no room, a lost connection): the caller computes
    the prefix itself. Anything else a request met (a socket timeout) is raised once the others are released."""
    if at_once(route):
        outcomes = _ask_each(route.clients, lambda client: admit_prefix_call(session_id, epoch, scope, digests, n_ctx))
    else:
        outcomes = []
        for client in route.clients:
            try:
                outcomes.append(client.admit_prefix(session_id, epoch, scope, digests, n_ctx=n_ctx))
            except (KvpoolError, ConnectionLost) as error:
                outcomes.append(error)
                break
    if len(outcomes) == len(route.clients) and not any(isinstance(outcome, Exception) for outcome in outcomes):
        return True
    for client, outcome in zip(route.clients, outcomes):
        if not isinstance(outcome, Exception):
            with contextlib.suppress(KvpoolError, ConnectionLost):
                client.release(session_id, epoch)
    _raise_unexpected(outcomes)
    return False


def restore_everywhere(route: Route, session_id: str, epoch: int, stages: Sequence[int]) -> list:
    """The session just admitted from a prefix restored on the daemons of `stages` at once (kvpool.wire.protocol.
    Restore), not bound to a direct channel, so that its first append still goes through each supervisor, which
    offers the blocks it completes to the store (saved after its reply). Each daemon's outcome (Done, or the error it
    met, a socket timeout among them): a restore that failed is left to that append, which restores a session
    still parked itself and answers as the contract says."""
    return _ask_each([route.clients[stage] for stage in stages], lambda client: restore_call(session_id, epoch))


class RestoringAhead:
    """restore_everywhere on the daemons after the first, in a thread of its own, while the caller's first
    append restores the session on the first daemon and computes its rows there: the later daemons' restores
    (mostly a context created for the session) happen beside that compute instead of before or after it. The
    caller waits (`wait`) before the second daemon's part of an append, and before anything else of the session
    goes to a daemon (kvpool.router.session.RoutedSession._restored); the wait is not cut short by a cancel,
    which the walk then honours before that part. For routes at_once of two daemons or more only (`start`)."""

    def __init__(self, route: Route, session_id: str, epoch: int) -> None:
        self.outcomes: list = []
        stages = range(1, len(route))
        self._thread = threading.Thread(target=self._run, args=(route, session_id, epoch, stages), name="kvpool-restore-ahead", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, route: Route, session_id: str, epoch: int) -> RestoringAhead | None:
        """Restores ahead of the first append on the later daemons, or None: the route is one daemon, or not at_once."""
        return cls(route, session_id, epoch) if len(route) > 1 and at_once(route) else None

    def _run(self, route: Route, session_id: str, epoch: int, stages: range) -> None:
        try:
            self.outcomes = restore_everywhere(route, session_id, epoch, stages)
        except Exception as error:  # noqa: BLE001 - whatever ask_all itself met: left to the appends, as any failed restore
            self.outcomes = [error]

    def wait(self) -> list:
        """Each later daemon's outcome, once every restore is answered."""
        self._thread.join()
        return self.outcomes


def _ask_each(clients: Sequence[Client], call_for) -> list:
    """Client.ask_all of `call_for(client)` on each of `clients` at once: each outcome, or the error it met."""
    return Client.ask_all([(client, call_for(client)) for client in clients])


def _raise_unexpected(outcomes: list) -> list:
    """The outcomes, once none is an error but a refusal (KvpoolError) or a lost connection (ConnectionLost):
    anything else (a socket timeout) is raised."""
    for outcome in outcomes:
        if isinstance(outcome, Exception) and not isinstance(outcome, (KvpoolError, ConnectionLost)):
            raise outcome
    return outcomes

"""Shared prefixes from the router's side (README, "Shared prefixes"): the block digests of a session's tokens
(kvpool.wire.prefix), sent with every append that completes a block so each daemon can offer the session's
state to its prefix store, and the reuse itself: look a prompt's blocks up on every daemon of the route, take
the longest length all of them hold (daemon k + 1 needs daemon k's rows for every position it does not hold)
and admit the session from that prefix on every daemon; the caller then computes only the rest."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from kvpool.client.client import ConnectionLost, KvpoolError
from kvpool.router.route import Route
from kvpool.wire.prefix import chain_digests


class PrefixChain:
    """The digests of one session's whole blocks, kept between appends (recomputed from the first block that
    differs when the tokens change under it: a truncate, a release)."""

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
    0 (no reuse) otherwise."""
    blocks = {getattr(getattr(client, "hello", None), "prefix_block", 0) for client in route.clients}  # a client without a Hello: none
    return blocks.pop() if len(blocks) == 1 else 0


def held_everywhere(route: Route, scope: str, digests: list[bytes]) -> int:
    """The leading blocks of `digests` every daemon of the route holds (0 when one holds none or fails)."""
    held = len(digests)
    for client in route.clients:
        if not held:
            break
        try:
            held = min(held, client.lookup_prefix(scope, digests[:held]))
        except (KvpoolError, ConnectionLost):
            return 0
    return held


def admit_everywhere(route: Route, session_id: str, epoch: int, scope: str, digests: list[bytes], n_ctx: int) -> bool:
    """Admit (session_id, epoch) from the prefix `digests` names on every daemon of the route; False, with
    what was admitted released again, when one cannot (the prefix evicted since the lookup, no room, a lost
    connection): the caller computes the prefix itself."""
    admitted = []
    for client in route.clients:
        try:
            client.admit_prefix(session_id, epoch, scope, digests, n_ctx=n_ctx)
        except (KvpoolError, ConnectionLost):
            for earlier in admitted:
                with contextlib.suppress(KvpoolError, ConnectionLost):
                    earlier.release(session_id, epoch)
            return False
        admitted.append(client)
    return True

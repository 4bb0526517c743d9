"""A route: the shards that together make the whole model, checked once, and one walk of a request
through the daemons that serve them (no recovery: kvpool.router.router decides what a failure means)."""

from __future__ import annotations

import typing
from collections.abc import Sequence

import numpy as np

from kvpool.client.client import AppendResult, Client, ConnectionLost, KvpoolError
from kvpool.client.messages import Call
from kvpool.shard.route import check_route
from kvpool.wire.protocol import Done
from kvpool.wire.sampling import Sampling


class StageFailed(KvpoolError):
    """A daemon of the route answered an error; `stage` is its place in the route (0: the first shard)."""

    def __init__(self, stage: int, error: KvpoolError) -> None:
        super().__init__(error.reply)
        self.stage = stage


class Route:
    """Clients of the daemons serving the shards of one model, first to last, checked by check_route
    (not owned: the caller closes them). Each call walks the route once and raises StageFailed (a
    KvpoolError) or ConnectionLost at the first daemon that fails, leaving the daemons before it as they
    are: what to do then is kvpool.router.router's policy."""

    def __init__(self, clients: Sequence[Client]) -> None:
        self.clients = list(clients)
        check_route([client.shard for client in self.clients])

    def __len__(self) -> int:
        return len(self.clients)

    def append_at(
        self, stage: int, session_id: str, epoch: int, start_pos: int, rows: Sequence[int] | np.ndarray, *,
        output_rows: str = "last", n_ctx: int = 0, admit_timeout_s: float = 0.0, sample: Sampling | None = None,
        block_digests: list[bytes] | None = None, prefix_scope: str = "",
    ) -> AppendResult:
        """One daemon's part of an append: token ids into the first, the previous daemon's rows elsewhere;
        `sample` goes to the last daemon only (it picks the next token there). `block_digests` (kvpool.wire.
        prefix): of the blocks the append completes, to every daemon."""
        client = self.clients[stage]
        inputs = {"tokens": list(rows)} if stage == 0 else {"hidden": rows}
        try:
            return client.append(
                session_id, epoch, start_pos, **inputs, output_rows=output_rows, n_ctx=n_ctx, admit_timeout_s=admit_timeout_s,
                sample=sample if stage == len(self.clients) - 1 else None, block_digests=block_digests or [], prefix_scope=prefix_scope,
            )
        except KvpoolError as error:
            raise StageFailed(stage, error) from None

    def append(
        self, session_id: str, epoch: int, start_pos: int, tokens: Sequence[int], *, output_rows: str = "last", n_ctx: int = 0
    ) -> np.ndarray:
        """The whole walk: token ids in, the last daemon's rows (logits) out."""
        rows: Sequence[int] | np.ndarray = tokens
        for stage in range(len(self)):
            rows = self.append_at(stage, session_id, epoch, start_pos, rows, output_rows=output_rows, n_ctx=n_ctx).rows
        assert isinstance(rows, np.ndarray)
        return rows

    def truncate(self, session_id: str, epoch: int, length: int, *, stages: Sequence[int] | None = None) -> None:
        for stage in range(len(self)) if stages is None else stages:
            try:
                self.clients[stage].truncate(session_id, epoch, length)
            except KvpoolError as error:
                raise StageFailed(stage, error) from None

    def park(self, session_id: str, epoch: int, *, wait: bool = True) -> list[Done]:
        """Park on every daemon at once: every request sent before any answer is read, the answers read as they
        come (Client.ask_all, in this thread), so the route's park takes as long as its slowest daemon's; each
        daemon's reply in route order; the first failure, by stage, is raised once every daemon has answered.
        Without `wait` each daemon answers once its save has begun (kvpool.wire.protocol.Park): about one round
        trip for the route (evidence/warm-tier/README.md, "Stop 44")."""
        return self._at_once([client.parking(session_id, epoch, wait=wait) for client in self.clients])

    def restore(self, session_id: str, epoch: int, *, admit_timeout_s: float = 0.0) -> list[Done]:
        """Restore on every daemon at once (kvpool.wire.protocol.Restore, as park: Client.ask_all), so the restores
        overlap where a restoring append would run them one daemon after another; each daemon's reply in route
        order ("restored", or "hot" where it was not parked), the first failure by stage raised once every daemon
        has answered. A client with direct channels gets the session's bound by the reply: the next append skips
        the supervisors."""
        return self._at_once([client.restoring(session_id, epoch, admit_timeout_s=admit_timeout_s) for client in self.clients])

    def _at_once(self, calls: list[Call[Done]]) -> list[Done]:
        """One call per daemon, in route order, through Client.ask_all; the first failure by stage raised."""
        outcomes = Client.ask_all(list(zip(self.clients, calls, strict=True)))
        failures = [StageFailed(stage, outcome) if isinstance(outcome, KvpoolError) else outcome
                    for stage, outcome in enumerate(outcomes) if not isinstance(outcome, Done)]
        if failures:
            raise failures[0]
        return typing.cast(list[Done], outcomes)

    def release(self, session_id: str, epoch: int) -> None:
        """Release on every daemon, also past one that fails; then raise the first failure, if any."""
        first_failure: Exception | None = None
        for stage, client in enumerate(self.clients):
            try:
                client.release(session_id, epoch)
            except KvpoolError as error:
                first_failure = first_failure or StageFailed(stage, error)
            except ConnectionLost as error:
                first_failure = first_failure or error
        if first_failure is not None:
            raise first_failure

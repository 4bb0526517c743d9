"""A route through shard daemons: what a router does for one session, shard after shard."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.client import Client


class DaemonRoute:
    """Clients of the daemons serving the shards of one model, first to last (not owned: caller closes)."""

    def __init__(self, clients: Sequence[Client]) -> None:
        self.clients = list(clients)
        shards = [client.shard for client in self.clients]
        if not shards or not shards[0].is_first or not shards[-1].is_last:
            raise ValueError("a route must start at the first shard and end at the last")
        for previous, following in zip(shards, shards[1:]):
            if previous.layer_stop != following.layer_start:
                raise ValueError(f"route has a gap or overlap at layer {previous.layer_stop}/{following.layer_start}")

    def append(
        self, session_id: str, epoch: int, start_pos: int, tokens: Sequence[int], *, output_rows: str = "last", n_ctx: int = 0
    ) -> np.ndarray:
        first, *rest = self.clients
        rows = first.append(session_id, epoch, start_pos, tokens=list(tokens), n_ctx=n_ctx).rows
        for client in rest:
            rows = client.append(session_id, epoch, start_pos, hidden=rows, output_rows=output_rows, n_ctx=n_ctx).rows
        return rows

    def truncate(self, session_id: str, epoch: int, length: int) -> None:
        for client in self.clients:
            client.truncate(session_id, epoch, length)

    def release(self, session_id: str, epoch: int) -> None:
        for client in self.clients:
            client.release(session_id, epoch)

"""Shards of one route run in order inside one process: the reference path and `kvpool generate`."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvpool.shard.header import read_shard_info
from kvpool.shard.route import check_route
from workers.runtime.context import OutputRows, ShardContext
from workers.runtime.model import ShardModel


class LocalChain:
    """Owns one ShardModel per shard, first to last; sessions are opened on it."""

    def __init__(
        self, shard_paths: Sequence[str | os.PathLike[str]], *, n_threads: int = 1, flash_attn: bool = False
    ) -> None:
        check_route([read_shard_info(path) for path in shard_paths])
        self.models: list[ShardModel] = []
        try:
            for path in shard_paths:
                self.models.append(ShardModel(path, n_threads=n_threads, flash_attn=flash_attn))
        except BaseException:
            self.close()
            raise

    def new_session(self, n_ctx: int) -> LocalChainSession:
        return LocalChainSession([model.new_context(n_ctx) for model in self.models])

    def close(self) -> None:
        for model in reversed(self.models):
            model.close()

    def __enter__(self) -> LocalChain:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class LocalChainSession:
    """One context per shard, advanced together; the positions of all of them stay equal."""

    def __init__(self, contexts: list[ShardContext]) -> None:
        self.contexts = contexts

    @property
    def length(self) -> int:
        return self.contexts[0].length

    def append(self, start_pos: int, tokens: Sequence[int], *, output_rows: OutputRows = "last") -> np.ndarray:
        first, *rest = self.contexts
        rows = first.append(start_pos, tokens=np.asarray(tokens, dtype=np.int32), output_rows=output_rows)
        for context in rest:
            rows = context.append(start_pos, hidden=rows, output_rows=output_rows)
        return rows

    def truncate(self, n: int) -> int:
        for context in self.contexts:
            context.truncate(n)
        return self.length

    def close(self) -> None:
        for context in self.contexts:
            context.close()

    def __enter__(self) -> LocalChainSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

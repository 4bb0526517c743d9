"""What a full context really takes, read in a fresh process that never held one: `python -m
tests.support.filled_context PATH N_CTX N_SEQS` creates the context as a kvpool worker does (one sequence:
ShardContext; more: the batched context of N_SEQS sequences), fills every sequence to N_CTX in 512-row
batches and prints, as JSON, the growth of the process's anonymous memory (the mmap'd weights left out)."""

from __future__ import annotations

import json
import sys

import numpy as np

from workers.runtime.batched import BatchedShardContext
from workers.runtime.model import ShardModel
from workers.server.readings import anonymous_bytes

ROWS = 512


def filled_growth(path: str, n_ctx: int, n_seqs: int, *, n_threads: int = 2) -> int:
    with ShardModel(path, n_threads=n_threads) as model:
        shape = model.shape
        batch = np.zeros(ROWS, np.int32) if shape.is_first else np.zeros((ROWS, shape.n_embd), np.float32)
        before = anonymous_bytes()
        if n_seqs == 1:
            context = model.new_context(n_ctx)
            for start in range(0, n_ctx, ROWS):
                rows = batch[: min(ROWS, n_ctx - start)]
                context.append(start, **({"tokens": rows} if shape.is_first else {"hidden": rows}))
        else:
            context = BatchedShardContext(model, n_ctx, n_seqs, n_batch=ROWS)
            for seq in range(n_seqs):
                for start in range(0, n_ctx, ROWS):
                    context.append_many([(seq, start, batch[: min(ROWS, n_ctx - start)])])
        grown = anonymous_bytes() - before
        context.close()
        return grown


if __name__ == "__main__":
    path, n_ctx, n_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps({"grown_bytes": filled_growth(path, n_ctx, n_seqs)}))

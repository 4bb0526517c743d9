"""What the fast tier's contract tests share: both modes' flags, and the rows a fake daemon must return for a
history (tests/support/fake_worker.expected_rows)."""

from __future__ import annotations

import numpy as np

from tests.support.fake_worker import expected_rows

MODES = ["process", "batched"]


def mode_flags(mode: str) -> tuple[str, ...]:
    """`kvpool serve` flags for `mode`: batched workers hold two sessions each."""
    return ("--mode", mode, "--seqs-per-worker", "2")


def tokens(*values: int) -> np.ndarray:
    return np.asarray(values, np.int32)


def rows_of(client, history) -> np.ndarray:
    """The rows the daemon behind `client` returns for a fresh session appending `history` (token ids)."""
    return expected_rows(client.hello.shard.shape, tokens(*history))

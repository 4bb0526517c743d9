"""What makes a call to a BatchedShardContext (workers.runtime.batched) valid: a sequence id in range, and a
batched append naming each sequence once, each item passing the append's rules of kvpool.wire.checks (rows of
the shard's kind and width, at its sequence's length, within n_ctx_per_seq). Every refusal is a typed error
carrying the length of the sequence it is about."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.wire.checks import check_output_rows, check_position, shard_rows
from kvpool.wire.shape import ShardShape
from workers.runtime.batch_plan import SeqAppend
from workers.runtime.errors import BadInput, wire_checks


def check_seq(seq: object, n_seqs: int) -> int:
    if not isinstance(seq, (int, np.integer)) or isinstance(seq, bool) or not 0 <= seq < n_seqs:
        raise BadInput(f"sequence must be an int in [0, {n_seqs}), not {seq!r}", length=0)
    return int(seq)


def named_seqs(items: Sequence[SeqAppend], n_seqs: int) -> list[int]:
    """The valid sequence ids the items name, invalid ones left out."""
    named = []
    for item in items:
        try:
            named.append(check_seq(item.seq, n_seqs))
        except BadInput:
            pass
    return named


def validated_appends(
    items: Sequence[SeqAppend], lengths: Sequence[int], n_ctx_per_seq: int, shape: ShardShape
) -> list[np.ndarray]:
    """Each item's rows, validated against `lengths` (every sequence's, by id) by the rules of kvpool.wire.checks;
    the first invalid item raises."""
    seen: set[int] = set()
    validated = []
    for item in items:
        seq = check_seq(item.seq, len(lengths))
        length = lengths[seq]
        if seq in seen:
            raise BadInput(f"sequence {seq} named twice in one call", length=length)
        seen.add(seq)
        with wire_checks(about=f"sequence {seq}: "):
            rows = shard_rows(shape, item.rows, length=length)
            check_output_rows(item.output_rows, length=length)
            check_position(item.start_pos, length, rows.shape[0], n_ctx_per_seq)
        validated.append(rows)
    return validated

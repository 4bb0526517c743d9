"""What makes a call to a BatchedShardContext (workers.runtime.batched) valid: a sequence id in range, rows of the
shard's kind and width, and a batched append naming each sequence once, at its length, within its
n_ctx_per_seq. Every refusal is a typed error carrying the length of the sequence it is about."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.wire.shape import ShardShape
from workers.runtime.batch_plan import SeqAppend
from workers.runtime.errors import BadInput, ContextFull, PositionMismatch


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


def validated_rows(rows: object, layout: ShardShape, length: int) -> np.ndarray:
    if layout.is_first:
        array = np.asarray(rows)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise BadInput("the first shard takes a 1-D sequence of token ids", length=length)
        if array.size and (array.min() < 0 or array.max() >= layout.n_vocab):
            raise BadInput(f"token ids must be in [0, {layout.n_vocab})", length=length)
        return array.astype(np.int32, copy=False)
    array = np.asarray(rows)
    if array.dtype != np.float32 or array.ndim != 2 or array.shape[1] != layout.n_embd:
        raise BadInput(
            f"hidden states must be float32 [n_rows, {layout.n_embd}], got {array.dtype} {array.shape}",
            length=length,
        )
    return np.ascontiguousarray(array)


def validated_appends(
    items: Sequence[SeqAppend], lengths: Sequence[int], n_ctx_per_seq: int, layout: ShardShape
) -> list[np.ndarray]:
    """Each item's rows, validated against `lengths` (every sequence's, by id); the first invalid item
    raises."""
    seen: set[int] = set()
    validated = []
    for item in items:
        seq = check_seq(item.seq, len(lengths))
        length = lengths[seq]
        if seq in seen:
            raise BadInput(f"sequence {seq} named twice in one call", length=length)
        seen.add(seq)
        if item.start_pos != length:
            raise PositionMismatch(f"sequence {seq}: start_pos {item.start_pos} != length {length}", length=length)
        if item.output_rows not in ("last", "all"):
            raise BadInput(f"output_rows must be 'last' or 'all', not {item.output_rows!r}", length=length)
        rows = validated_rows(item.rows, layout, length)
        if rows.shape[0] == 0:
            raise BadInput("an append needs at least one row", length=length)
        if length + rows.shape[0] > n_ctx_per_seq:
            raise ContextFull(
                f"sequence {seq}: {length} + {rows.shape[0]} rows exceed n_ctx_per_seq {n_ctx_per_seq}",
                length=length,
            )
        validated.append(rows)
    return validated

"""How one batched append of several sequences is cut into llama_decode calls (see workers.runtime.batched): each
call exactly one llama.cpp ubatch of consecutive sequence ids with equal row counts, and each sequence's
rows cut into n_batch chunks as `ShardContext` cuts an append."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from workers.runtime.context import OutputRows


class SeqAppend(NamedTuple):
    """One sequence's rows in a batched append: token ids (first shard) or float32 hidden states."""

    seq: int
    start_pos: int
    rows: object
    output_rows: OutputRows = "last"


class UbatchSlice(NamedTuple):
    """Rows [row_start, row_stop) of one item's rows, inside one ubatch."""

    item: int
    seq: int
    row_start: int
    row_stop: int


def plan_ubatches(seqs: Sequence[int], row_counts: Sequence[int], n_batch: int) -> list[list[UbatchSlice]]:
    """The llama_decode calls of one batched append, each a single llama.cpp ubatch.

    Each item is cut into chunks of n_batch rows, as `ShardContext` cuts an append, so a sequence's
    row partition never depends on the other items. Round r decodes every item's chunk r: chunks of
    equal length from consecutive sequence ids share a call, at most n_batch rows per call.
    """
    plan: list[list[UbatchSlice]] = []
    n_rounds = max(-(-count // n_batch) for count in row_counts)
    for round_index in range(n_rounds):
        by_length: dict[int, list[UbatchSlice]] = {}
        for item, (seq, count) in enumerate(zip(seqs, row_counts)):
            start = round_index * n_batch
            if start < count:
                stop = min(count, start + n_batch)
                by_length.setdefault(stop - start, []).append(UbatchSlice(item, seq, start, stop))
        for length in sorted(by_length):
            per_call = n_batch // length
            call: list[UbatchSlice] = []
            for piece in sorted(by_length[length], key=lambda piece: piece.seq):
                if call and (piece.seq != call[-1].seq + 1 or len(call) == per_call):
                    plan.append(call)
                    call = []
                call.append(piece)
            plan.append(call)
    return plan

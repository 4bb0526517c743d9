"""Where a shard sits in its whole model: the one value type for it, read from the GGUF header by the
file reader, from the loaded model by the worker, and carried on the wire in the daemon's Hello reply."""

from __future__ import annotations

import msgspec


class ShardShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Layers [layer_start, layer_stop) of a model of total_layers layers; n_vocab as llama.cpp sees the
    file (32 for a vocabulary-free middle shard)."""

    layer_start: int
    layer_stop: int
    total_layers: int
    n_embd: int
    n_vocab: int

    @property
    def n_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def is_first(self) -> bool:
        """Takes token ids (holds the embeddings)."""
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        """Returns logits (holds the output head)."""
        return self.layer_stop == self.total_layers

    @property
    def input_width(self) -> int:
        """Values per input row: 1 token id on the first shard, n_embd hidden-state floats elsewhere."""
        return 1 if self.is_first else self.n_embd

    @property
    def output_width(self) -> int:
        """Floats per output row: logits on the last shard, hidden states elsewhere."""
        return self.n_vocab if self.is_last else self.n_embd

    def output_shape(self, n_rows: int, output_rows: str) -> tuple[int, int]:
        """What an append of `n_rows` returns: every row's hidden states (a non-final shard), else the logits of the
        last row, or of every row with output_rows "all"."""
        return (n_rows if output_rows == "all" or not self.is_last else 1, self.output_width)

    def __str__(self) -> str:
        return f"layers [{self.layer_start}, {self.layer_stop}) of {self.total_layers}"

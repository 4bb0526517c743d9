"""Layer ranges [A, B) of a model: one range ("A:B"), a route's splits ("0:10,10:20,20:30"), even splits."""

from __future__ import annotations

import dataclasses
import re

from kvpool.shard.errors import ShardError

_RANGE_TEXT = re.compile(r"(\d+):(\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class LayerRange:
    """Half-open layer range [start, stop); never empty."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ShardError(f"layer range {self} starts below 0")
        if self.stop <= self.start:
            raise ShardError(f"layer range {self} is empty: the stop layer must be greater than the start layer")

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    @property
    def n_layers(self) -> int:
        return self.stop - self.start


def parse_layers(text: str) -> LayerRange:
    """Parse "A:B" (half-open) into a LayerRange."""
    match = _RANGE_TEXT.fullmatch(text.strip())
    if match is None:
        raise ShardError(f"bad layer range {text!r}: expected START:STOP, e.g. 0:10")
    return LayerRange(int(match.group(1)), int(match.group(2)))


def validate_range(layers: LayerRange, total_layers: int) -> None:
    if layers.stop > total_layers:
        raise ShardError(
            f"layer range {layers} is out of bounds: the model has {total_layers} layers (0:{total_layers})"
        )


def parse_splits(text: str, total_layers: int) -> list[LayerRange]:
    """Parse "0:10,10:20,20:30": ranges that together cover [0, total_layers) exactly once, in layer order."""
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ShardError(f"bad splits {text!r}: expected comma-separated START:STOP ranges, e.g. 0:10,10:30")
    ranges = sorted((parse_layers(item) for item in items), key=lambda r: (r.start, r.stop))
    covered = 0
    previous: LayerRange | None = None
    for layer_range in ranges:
        validate_range(layer_range, total_layers)
        if layer_range.start < covered:
            raise ShardError(f"splits overlap: {previous} and {layer_range} share layers {layer_range.start}:{covered}")
        if layer_range.start > covered:
            raise ShardError(f"splits leave a gap: layers {covered}:{layer_range.start} are in no range")
        covered = layer_range.stop
        previous = layer_range
    if covered < total_layers:
        raise ShardError(f"splits leave a gap: layers {covered}:{total_layers} are in no range")
    return ranges


def even_splits(total_layers: int, parts: int) -> list[LayerRange]:
    """Split [0, total_layers) into `parts` contiguous ranges whose sizes differ by at most one; earlier are larger."""
    if parts < 1:
        raise ShardError(f"cannot split into {parts} parts: need at least 1")
    if parts > total_layers:
        raise ShardError(f"cannot split {total_layers} layers into {parts} parts: at most {total_layers}")
    base, extra = divmod(total_layers, parts)
    ranges: list[LayerRange] = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        ranges.append(LayerRange(start, stop))
        start = stop
    return ranges

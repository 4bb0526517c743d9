"""The route check: shards (files read here, or what daemons say they serve) that together make the whole
model, in order, from one source."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from kvpool.shard.errors import ShardError
from kvpool.shard.header import ShardInfo
from kvpool.wire.protocol import ShardDescription

Shard = ShardInfo | ShardDescription  # a shard file read here, or the shard a daemon says it serves


def _name(shard: Shard) -> str:
    return shard.path.name if isinstance(shard, ShardInfo) else pathlib.PurePath(shard.model_path).name


def check_route(shards: Sequence[Shard]) -> None:
    """Raise ShardError unless the shards cover [0, total) exactly, in order, from one source model."""
    if not shards:
        raise ShardError("a route needs at least one shard")
    total = shards[0].shape.total_layers
    expected_start = 0
    for shard in shards:
        shape = shard.shape
        if shape.total_layers != total or shard.source_sha256 != shards[0].source_sha256:
            raise ShardError(f"{_name(shard)} comes from a different model than {_name(shards[0])}")
        if shape.layer_start != expected_start:
            raise ShardError(
                f"route has a gap or overlap: expected a shard starting at layer {expected_start}, "
                f"got {_name(shard)} [{shape.layer_start}, {shape.layer_stop})"
            )
        expected_start = shape.layer_stop
    if expected_start != total:
        raise ShardError(f"route ends at layer {expected_start}, the model has {total}")

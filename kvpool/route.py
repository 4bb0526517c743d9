"""A route: the shards that together make the whole model, checked to be contiguous and of one source."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.gguf_header import ShardInfo
from kvpool.shard_error import ShardError


def check_route(shards: Sequence[ShardInfo]) -> None:
    """Raise ShardError unless the shards cover [0, total) exactly, in order, from one source model."""
    if not shards:
        raise ShardError("a route needs at least one shard")
    total = shards[0].total_layers
    expected_start = 0
    for shard in shards:
        if shard.total_layers != total or shard.source_sha256 != shards[0].source_sha256:
            raise ShardError(f"{shard.path.name} comes from a different model than {shards[0].path.name}")
        if shard.layer_start != expected_start:
            raise ShardError(
                f"route has a gap or overlap: expected a shard starting at layer {expected_start}, "
                f"got {shard.path.name} [{shard.layer_start}, {shard.layer_stop})"
            )
        expected_start = shard.layer_stop
    if expected_start != total:
        raise ShardError(f"route ends at layer {expected_start}, the model has {total}")

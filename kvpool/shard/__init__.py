"""Shard files: a GGUF model cut into layer ranges (written byte for byte, read back by header), the bundled
model, the cache of cut shards, and the check that shards make a whole route."""

from kvpool.shard.bundled import BundledModelMissing, bundled_model_path
from kvpool.shard.cache import cached_shards
from kvpool.shard.errors import ShardError
from kvpool.shard.header import ShardInfo, read_shard_info
from kvpool.shard.ranges import LayerRange, even_splits, parse_layers, parse_splits
from kvpool.shard.route import check_route
from kvpool.shard.writer import write_shard, write_shards

__all__ = [
    "BundledModelMissing", "LayerRange", "ShardError", "ShardInfo", "bundled_model_path", "cached_shards", "check_route",
    "even_splits", "parse_layers", "parse_splits", "read_shard_info", "write_shard", "write_shards",
]

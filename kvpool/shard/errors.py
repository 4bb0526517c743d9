"""ShardError: a shard file, a layer range or a route of shards that kvpool cannot use."""

from __future__ import annotations


class ShardError(Exception):
    """A shard cannot be read or written; the message is one user-facing line."""

"""Shards of a source model cut on demand and kept under the work directory, keyed by the source's hash."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

from kvpool.config import work_dir
from kvpool.shardfile import (
    LayerRange,
    ShardInfo,
    file_sha256,
    read_shard_info,
    shard_file_name,
    write_shards,
)


def cached_shards(
    source: pathlib.Path,
    ranges: Sequence[LayerRange],
    *,
    progress: Callable[[str], None] | None = None,
    root: pathlib.Path | None = None,
) -> list[ShardInfo]:
    """The shards of `source` for `ranges`, written once into <work dir>/shards/<sha12>/ and reused."""
    source_sha256 = file_sha256(source)
    directory = (root or work_dir() / "shards") / source_sha256[:12]
    paths = [directory / shard_file_name(source, layers) for layers in ranges]
    if all(path.is_file() for path in paths):
        infos = [read_shard_info(path) for path in paths]
        if all(info.source_sha256 == source_sha256 for info in infos):
            return infos
    return write_shards(source, ranges, directory, progress=progress)


def shards_in_directory(directory: pathlib.Path) -> list[ShardInfo]:
    """The shard files of one model in `directory`, ordered by layer range."""
    infos = sorted(
        (read_shard_info(path) for path in directory.glob("*.gguf") if not path.name.startswith(".")),
        key=lambda info: info.layer_start,
    )
    return infos

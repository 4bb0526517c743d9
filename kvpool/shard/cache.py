"""Shards of a source model cut on demand and kept under the work directory, keyed by the source's hash."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

from kvpool.host import work_dir
from kvpool.shard.contents import lookahead_layers
from kvpool.shard.header import ShardInfo, file_sha256, read_shard_info
from kvpool.shard.ranges import LayerRange, even_splits
from kvpool.shard.writer import shard_file_name, write_shards


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
        # a shard written by an older kvpool (no lookahead layer on the first shard, no layer digests) is cut again
        if all(
            info.source_sha256 == source_sha256
            and info.lookahead_layers == lookahead_layers(info.shape.total_layers, info.layers)
            and info.layer_sha256 is not None
            for info in infos
        ):
            return infos
    return write_shards(source, ranges, directory, progress=progress)


def shards_in_parts(
    source: pathlib.Path, parts: int, *, progress: Callable[[str], None] | None = None
) -> list[ShardInfo]:
    """`source` cut into `parts` even shards (cached as above); one part is the source file itself."""
    if parts == 1:
        return [read_shard_info(source)]  # the whole model needs no shard file
    return cached_shards(source, even_splits(read_shard_info(source).shape.total_layers, parts), progress=progress)


def shards_in_directory(directory: pathlib.Path) -> list[ShardInfo]:
    """The shard files of one model in `directory`, ordered by layer range."""
    infos = sorted(
        (read_shard_info(path) for path in directory.glob("*.gguf") if not path.name.startswith(".")),
        key=lambda info: info.shape.layer_start,
    )
    return infos

"""Writing shard files: one layer range, or every range of a route at once (all or nothing).

A shard is written with gguf-py (the reader/writer llama.cpp publishes); what it holds is
kvpool/shard/contents.py. Files appear atomically: written to `.{name}.partial-{pid}` beside the target,
then renamed. The source is hashed once per call: its file (the shards' source_sha256) and its layers (the
digests every shard records of the blocks it stores: kvpool.shard.digests).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterable, Sequence

import gguf

from kvpool.shard.contents import shard_info, write_shard_file
from kvpool.shard.digests import block_digests
from kvpool.shard.errors import ShardError
from kvpool.shard.header import ShardInfo, check_model_file, file_sha256, read_whole_model_info
from kvpool.shard.ranges import LayerRange, validate_range

Progress = Callable[[str], None]


def shard_file_name(source: str | os.PathLike[str], layers: LayerRange) -> str:
    return f"{pathlib.Path(source).stem}.layers-{layers.start:02d}-{layers.stop:02d}.gguf"


def write_shard(
    source: str | os.PathLike[str],
    layers: LayerRange,
    out: str | os.PathLike[str],
    *,
    source_sha256: str | None = None,
    progress: Progress | None = None,
) -> ShardInfo:
    """Write the shard of `source` holding `layers` to `out` (a file, or an existing directory to write into)."""
    source, out = pathlib.Path(source), pathlib.Path(out)
    report = progress or _silent
    model = read_whole_model_info(source)
    validate_range(layers, model.shape.total_layers)
    if out.is_dir():
        out = out / shard_file_name(source, layers)
    _refuse_overwriting_source(source, out)
    report(f"reading {source.name}")
    reader = _open_reader(source)
    created_dirs = _make_directory(out.parent)
    try:
        if source_sha256 is None:
            report("hashing source")
            source_sha256 = file_sha256(source)
        else:
            report("hashing source layers")  # a given file hash is trusted; the layers' digests are not given
        written = _publish(reader, model, [(layers, out)], source_sha256, block_digests(source), report)
    except BaseException:
        _remove_empty_directories(created_dirs)
        raise
    return written[0]


def write_shards(
    source: str | os.PathLike[str],
    ranges: Sequence[LayerRange],
    out_dir: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> list[ShardInfo]:
    """Write one shard per range into `out_dir`, all or nothing; the source is hashed once."""
    source, out_dir = pathlib.Path(source), pathlib.Path(out_dir)
    report = progress or _silent
    if not ranges:
        raise ShardError("no layer ranges given")
    if len(set(ranges)) != len(ranges):
        raise ShardError(f"a layer range is given twice: {','.join(map(str, ranges))}")
    model = read_whole_model_info(source)
    for layers in ranges:
        validate_range(layers, model.shape.total_layers)
    if out_dir.exists() and not out_dir.is_dir():
        raise ShardError(f"output {out_dir} exists and is not a directory")
    targets = [(layers, out_dir / shard_file_name(source, layers)) for layers in ranges]
    for _, target in targets:
        _refuse_overwriting_source(source, target)
    report(f"reading {source.name}")
    reader = _open_reader(source)
    created_dirs = _make_directory(out_dir)
    try:
        report("hashing source")
        return _publish(reader, model, targets, file_sha256(source), block_digests(source), report)
    except BaseException:
        _remove_empty_directories(created_dirs)
        raise


def _silent(_message: str) -> None:
    pass


def _open_reader(path: pathlib.Path) -> gguf.GGUFReader:
    check_model_file(path)
    try:
        reader = gguf.GGUFReader(path)
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except Exception as exc:  # the parser fails in many ways on bytes that are not GGUF
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShardError(f"{path} is not a GGUF file ({reason})") from exc
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ShardError(f"{path} is a big-endian GGUF file, which kvpool does not support")
    return reader


def _refuse_overwriting_source(source: pathlib.Path, target: pathlib.Path) -> None:
    if target.exists() and target.resolve() == source.resolve():
        raise ShardError(f"output {target} is the source model itself")


def _make_directory(directory: pathlib.Path) -> list[pathlib.Path]:
    """Create `directory` and missing parents; return those created, deepest first."""
    missing: list[pathlib.Path] = []
    probe = directory
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise ShardError(f"output {probe} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardError(f"cannot create directory {directory}: {exc.strerror or exc}") from exc
    return missing


def _remove_empty_directories(directories: Iterable[pathlib.Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


def _partial_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(f".{target.name}.partial-{os.getpid()}")


def _publish(
    reader: gguf.GGUFReader,
    model: ShardInfo,
    targets: Sequence[tuple[LayerRange, pathlib.Path]],
    source_sha256: str,
    source_layer_sha256: Sequence[str],
    report: Progress,
) -> list[ShardInfo]:
    """Write every target to its partial file, then rename them all into place; on failure leave none behind."""
    partials: list[pathlib.Path] = []
    published: list[pathlib.Path] = []
    try:
        for index, (layers, target) in enumerate(targets, start=1):
            report(f"writing {target.name}" + (f" ({index}/{len(targets)})" if len(targets) > 1 else ""))
            partial = _partial_path(target)
            partials.append(partial)
            write_shard_file(reader, model, layers, source_sha256, source_layer_sha256, partial)
        for partial, (_, target) in zip(partials, targets):
            os.replace(partial, target)
            published.append(target)
    except OSError as exc:
        _unlink_all([*partials, *published])
        target = exc.filename2 or exc.filename or "shard"
        raise ShardError(f"cannot write {target}: {exc.strerror or exc}") from exc
    except BaseException:
        _unlink_all([*partials, *published])
        raise
    return [shard_info(model, layers, target, source_sha256, source_layer_sha256) for layers, target in targets]


def _unlink_all(paths: Iterable[pathlib.Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # not ours to remove: something else (a directory) stands at that path

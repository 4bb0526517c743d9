"""`kvpool shard`: write layer-range shard files of a llama-family GGUF model."""

from __future__ import annotations

import argparse
import pathlib
import sys

from kvpool.shard.bundled import BundledModelMissing, bundled_model_path
from kvpool.shard.errors import ShardError
from kvpool.shard.header import ShardInfo, file_sha256, read_shard_info
from kvpool.shard.ranges import even_splits, parse_layers, parse_splits
from kvpool.shard.writer import write_shard, write_shards

DESCRIPTION = """\
Write shard files of a llama-family GGUF model: each holds the layers [START, STOP) and loads in llama.cpp
as a model of STOP - START layers. Tensors are copied byte for byte (no re-quantization). The first shard
keeps the vocabulary and embeddings (it takes token ids), the last keeps the output head (it produces
logits), and a middle shard is written vocabulary-free, so it is much smaller than the others.
Files appear atomically: nothing is left behind when writing fails."""

EPILOG = """\
examples:
  kvpool shard --layers 10:20 -o mid.gguf          one shard of the bundled model
  kvpool shard model.gguf --splits 0:10,10:20,20:30 -o shards/
  kvpool shard model.gguf --parts 3 -o shards/     as even as possible; earlier shards get the extra layer

On success, one line per shard on stdout, tab-separated: path, layer range, size in bytes, sha256."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "shard",
        help="write layer-range shard files of a GGUF model",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        nargs="?",
        metavar="SRC.gguf",
        help="the whole model to shard (default: the bundled SmolLM2-135M-Instruct Q4_1)",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--layers", metavar="START:STOP", help="write one shard holding layers [START, STOP)")
    mode.add_argument(
        "--splits",
        metavar="A:B,B:C,...",
        help="write one shard per range; the ranges must cover every layer exactly once",
    )
    mode.add_argument("--parts", metavar="N", type=int, help="write N shards of (nearly) equal layer counts")
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        required=True,
        help="with --layers: the shard file (or a directory to write it into); "
        "with --splits/--parts: the directory to write into (created if missing)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        source = pathlib.Path(args.source) if args.source else bundled_model_path()
    except BundledModelMissing as exc:
        return _fail(str(exc))
    try:
        written = _write(source, args)
        for info in written:
            _progress(f"hashing {info.path.name}")
            size = info.path.stat().st_size
            print(f"{info.path}\t{info.layers}\t{size}\t{file_sha256(info.path)}")
    except ShardError as exc:
        return _fail(str(exc))
    return 0


def _write(source: pathlib.Path, args: argparse.Namespace) -> list[ShardInfo]:
    output = pathlib.Path(args.output)
    if args.layers is not None:
        layers = parse_layers(args.layers)
        return [write_shard(source, layers, output, progress=_progress)]
    total_layers = read_shard_info(source).shape.total_layers
    if args.splits is not None:
        ranges = parse_splits(args.splits, total_layers)
    else:
        ranges = even_splits(total_layers, args.parts)
    return write_shards(source, ranges, output, progress=_progress)


def _progress(message: str) -> None:
    print(f"kvpool shard: {message}", file=sys.stderr, flush=True)


def _fail(message: str) -> int:
    print(f"kvpool shard: error: {message}", file=sys.stderr)
    return 2

"""`kvpool bench`: kvpool side by side with llama.cpp's own single- and multi-session decoding."""

from __future__ import annotations

import argparse
import sys

import kvpool.bench
from kvpool.bench import cli as bench
from kvpool.bench.rigs import RigFailed
from kvpool.launcher import DaemonStartFailed
from kvpool.shard.bundled import BundledModelMissing
from kvpool.shard.errors import ShardError


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "bench",
        help="benchmark kvpool against llama.cpp in-process and batched (one table, JSON, PNG)",
        description=kvpool.bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return bench.run(args)
    except (ShardError, BundledModelMissing, DaemonStartFailed, RigFailed, ValueError) as error:
        print(f"kvpool bench: error: {error}", file=sys.stderr)
        return 2

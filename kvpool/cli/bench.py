"""`kvpool bench`: kvpool side by side with llama.cpp's own single- and multi-session decoding."""

from __future__ import annotations

import argparse
import os
import sys

import kvpool.bench
from kvpool.bench import cli as bench
from kvpool.host import GLIBC_TUNABLES_ENV, glibc_tunables, huge_page_environment
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


def _start_with_the_workers_malloc() -> None:
    """The bench's in-process references (the same shard in-process, llama.cpp's whole model and its batched
    decoding) run with the malloc a daemon's workers get by default (--huge-pages auto): where that needs a
    GLIBC_TUNABLES this process did not start with, the command starts again with it (glibc reads it only when a
    process starts), so that neither side of a ratio has huge pages the other lacks. A GLIBC_TUNABLES of the
    user's own that names glibc.malloc.hugetlb is kept, for the daemons too: setting it to 0 measures both without."""
    wanted = huge_page_environment()
    if not wanted or wanted[GLIBC_TUNABLES_ENV] == glibc_tunables():
        return
    print(f"kvpool bench: starting again with {GLIBC_TUNABLES_ENV}={wanted[GLIBC_TUNABLES_ENV]}, as a daemon's workers get it", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kvpool", *sys.argv[1:]], {**os.environ, **wanted})


def run(args: argparse.Namespace) -> int:
    _start_with_the_workers_malloc()
    try:
        return bench.run(args)
    except (ShardError, BundledModelMissing, DaemonStartFailed, ValueError) as error:
        print(f"kvpool bench: error: {error}", file=sys.stderr)
        return 2

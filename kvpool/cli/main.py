"""`kvpool` command line: one subcommand per module, each with add_parser() and run()."""

from __future__ import annotations

import argparse
import sys

from kvpool.cli import bench, demo, generate, serve, shard, status, stress

SUBCOMMANDS = (demo, shard, generate, serve, status, bench, stress)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description=(
            "Shard-local hot KV state for distributed llama.cpp inference: cut a GGUF model into layer "
            "shards, serve a shard's per-session KV caches from a daemon, and generate through a route."
        ),
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("kvpool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

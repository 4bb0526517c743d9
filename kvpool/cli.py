"""`kvpool` command line: one subcommand per module, each with add_parser() and run()."""

from __future__ import annotations

import argparse
import sys

from kvpool import cli_bench, cli_demo, cli_generate, cli_serve, cli_shard, cli_status, cli_stress

SUBCOMMANDS = (cli_demo, cli_shard, cli_generate, cli_serve, cli_status, cli_bench, cli_stress)


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

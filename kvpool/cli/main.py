"""`kvpool` command line: one subcommand per module (kvpool.cli.<name>), each with add_parser() and run().

A command imports only its own module: `kvpool serve` (what every daemon start runs) does not load the bench,
the stress harness or llama.cpp's Python bindings in its supervisor; `kvpool`, `kvpool --help` or a name
that is no subcommand builds the parser of every one."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("demo", "shard", "generate", "serve", "status", "bench", "stress")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of `only` (one of SUBCOMMANDS) alone."""
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description=(
            "Shard-local hot KV state for distributed llama.cpp inference: cut a GGUF model into layer "
            "shards, serve a shard's per-session KV caches from a daemon, and generate through a route."
        ),
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        if only is None or name == only:
            importlib.import_module(f"kvpool.cli.{name}").add_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(named).parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("kvpool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

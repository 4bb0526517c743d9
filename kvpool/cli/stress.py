"""`kvpool stress`: concurrent sessions through a chain of daemons, fault drills, exactness (kvpool.stress)."""

from __future__ import annotations

import argparse

from kvpool.stress import cli as stress


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "stress",
        help="drive concurrent sessions and fault drills through a chain of daemons; check each against a run alone",
        description=stress.DESCRIPTION,
    )
    stress.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return stress.run(args)

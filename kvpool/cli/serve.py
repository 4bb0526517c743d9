"""`kvpool serve`: run the shard daemon in the foreground until SIGTERM, SIGINT or a shutdown request."""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib

from kvpool.cli.config_file import file_keys, with_file
from kvpool.daemon.config import ServeConfig, flags
from kvpool.daemon.lifeline import watch_lifeline
from kvpool.daemon.logs import LOG_FORMATS
from kvpool.daemon.logs import configure as configure_logs
from kvpool.daemon.notify import Notifier
from kvpool.daemon.pool.handle import WorkerStartFailed
from kvpool.daemon.pool.shm_room import SharedMemoryTooSmall
from kvpool.daemon.supervisor import Supervisor
from kvpool.daemon.transport.listener import SocketSetupError
from kvpool.host import notify_socket_address, work_dir
from kvpool.shard.bundled import BundledModelMissing, bundled_model_path
from kvpool.shard.errors import ShardError

log = logging.getLogger("kvpool.serve")


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "serve",
        help="serve one shard's per-session KV caches over a Unix socket",
        description=(
            "Run a shard daemon: a supervisor and a pool of warm worker processes, each holding the shard "
            "and at most one bounded llama context bound to one (route_session_id, route_epoch) (--mode batched: "
            "one context whose sequences serve --seqs-per-worker sessions, decoded together). Sessions "
            "are admitted against a byte budget; when a place is needed the least recently used idle session "
            "is parked (its state saved to the spill store and restored by its next append) or, with the warm "
            "tier off or full, evicted; sessions expire after --ttl seconds idle in any tier. Stop with SIGTERM or "
            "`kvpool status --drain` (a drain: see --drain-timeout), or at once with Ctrl-C or `kvpool status --shutdown`."
        ),
    )
    define_options(parser)
    parser.set_defaults(func=run)


def define_options(parser: argparse.ArgumentParser) -> None:
    """Every `kvpool serve` flag (also the keys a --config file may set: kvpool.cli.config_file): the daemon's
    settings as ServeConfig declares them (kvpool.daemon.config.flag), and the few that are not settings."""
    parser.add_argument("--config", type=pathlib.Path, metavar="FILE.toml", help="read flags from a TOML file: its keys are these flags' names without the leading dashes (n-ctx = 1024, max-sessions = 8, budget = \"1GiB\", flash-attn = true), relative paths are relative to the file; a flag given on the command line overrides the file's value; an unknown key or a value of the wrong type is refused")
    parser.add_argument("--log-format", choices=LOG_FORMATS, help="text: `kvpool serve: message` lines (the default); json: one JSON object per line (time, level, message, logger, pid and the line's fields)")
    parser.add_argument("--model", type=pathlib.Path, help="shard GGUF to serve (default: the whole bundled model)")
    parser.add_argument("--socket", type=pathlib.Path, help="Unix socket path (default: <work dir>/run/<model>.sock); its directory must be yours and private")
    parser.add_argument("--lifeline-fd", type=int, help="an inherited pipe's read end: the daemon shuts down when it reaches end-of-file, i.e. when the program that started it is gone (kvpool's launcher passes it)")
    for _field, option in flags():
        parser.add_argument(option.name, dest=option.dest, default=None, help=option.help_text(), **option.argparse)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The settings the command line (or its --config file) gave; every other field keeps its default."""
    model = args.model or bundled_model_path()
    socket_path = args.socket or work_dir() / "run" / f"{model.stem}.sock"
    given = {
        field: option.parse(value) if option.parse is not None else value
        for field, option in flags() if (value := getattr(args, option.dest)) is not None
    }
    return ServeConfig(model=model.resolve(), socket=socket_path.absolute(), **given)


def with_config_file(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the flags the command line left unset taken from --config's file (when one is named)."""
    if args.config is None:
        return args
    options = argparse.ArgumentParser(add_help=False)
    define_options(options)
    return with_file(args, args.config, file_keys(options))


def run(args: argparse.Namespace) -> int:
    configure_logs(args.log_format or "text")
    try:
        args = with_config_file(args)
        configure_logs(args.log_format or "text")  # the file may name it
        config = config_from_args(args)
        if not config.model.is_file():
            raise ShardError(f"model file not found: {config.model}")
        supervisor = Supervisor(config, announce=log.info, notifier=Notifier(notify_socket_address()))
        if args.lifeline_fd is not None:
            watch_lifeline(args.lifeline_fd, socket_path=config.socket)
        asyncio.run(supervisor.run())
    except (ValueError, ShardError, BundledModelMissing, SocketSetupError, SharedMemoryTooSmall, WorkerStartFailed, OSError) as error:
        log.error("error: %s", error)
        return 2
    return supervisor.exit_code

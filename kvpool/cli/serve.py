"""`kvpool serve`: run the shard daemon in the foreground until SIGTERM, SIGINT or a shutdown request."""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib

from kvpool.shard.bundled import BundledModelMissing, bundled_model_path
from kvpool.cli.config_file import file_keys, with_file
from kvpool.daemon.config import DEFAULT_MAX_BUFFERED_BYTES, ServeConfig
from kvpool.daemon.logs import LOG_FORMATS, configure as configure_logs
from kvpool.daemon.notify import Notifier
from kvpool.host import format_bytes, notify_socket_address, parse_bytes, work_dir
from kvpool.daemon.lifeline import watch_lifeline
from kvpool.daemon.pool.shm_room import SharedMemoryTooSmall
from kvpool.daemon.transport.listener import SocketSetupError
from kvpool.shard.errors import ShardError
from kvpool.daemon.supervisor import Supervisor
from kvpool.daemon.pool.handle import WorkerStartFailed


DEFAULTS = ServeConfig.defaults()

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
    """Every `kvpool serve` flag (also the keys a --config file may set: kvpool.cli.config_file)."""
    parser.add_argument("--config", type=pathlib.Path, metavar="FILE.toml", help="read flags from a TOML file: its keys are these flags' names without the leading dashes (n-ctx = 1024, max-sessions = 8, budget = \"1GiB\", flash-attn = true), relative paths are relative to the file; a flag given on the command line overrides the file's value; an unknown key or a value of the wrong type is refused")
    parser.add_argument("--log-format", choices=LOG_FORMATS, help="text: `kvpool serve: message` lines (the default); json: one JSON object per line (time, level, message, logger, pid and the line's fields)")
    parser.add_argument("--model", type=pathlib.Path, help="shard GGUF to serve (default: the whole bundled model)")
    parser.add_argument("--socket", type=pathlib.Path, help="Unix socket path (default: <work dir>/run/<model>.sock); its directory must be yours and private")
    parser.add_argument("--budget", help=f"bytes all sessions' contexts may reserve, e.g. 1GiB, 512MiB (default {format_bytes(DEFAULTS['budget_bytes'])})")
    parser.add_argument("--max-sessions", type=int, help=f"live sessions at most = warm worker processes (default {DEFAULTS['max_sessions']})")
    parser.add_argument("--ttl", type=float, help=f"seconds an idle session lives (default {DEFAULTS['ttl_s']:g})")
    parser.add_argument("--threads", type=int, help=f"llama threads computing at once across all workers (default: cores available, {DEFAULTS['threads']})")
    parser.add_argument("--threads-per-worker", type=int, help=f"process mode: llama threads per worker (default {DEFAULTS['threads_per_worker']}); a batched worker process gets --threads divided by the number of worker processes")
    parser.add_argument("--n-ctx", type=int, help=f"largest (and default) context per session (default {DEFAULTS['n_ctx']})")
    parser.add_argument("--max-request-bytes", help=f"largest request frame accepted (default {format_bytes(DEFAULTS['max_request_bytes'])})")
    parser.add_argument("--request-timeout", type=float, help=f"seconds a worker may take to answer one call (an append of --n-ctx rows included); a worker that does not is killed and replaced, and its request answered worker_lost (default {DEFAULTS['request_timeout_s']:g})")
    parser.add_argument("--housekeeping-interval", type=float, help=f"seconds between housekeeping passes: TTL expiry, replacing dead idle workers, memory checks (default {DEFAULTS['housekeeping_interval_s']:g})")
    parser.add_argument("--min-residency", type=float, metavar="S", help="an idle session that appended within the last S seconds is not evicted to admit another: the admission waits for it to lapse instead (default: derived at start-up from the measured decode step, a few of the route's steps; 0 turns it off)")
    parser.add_argument("--admit-queue", type=int, metavar="N", help=f"admissions that may wait for room at once, served first come first served; one more is answered over_budget with retry_after_s (default {DEFAULTS['admit_queue_limit']})")
    parser.add_argument("--fence-ids", type=int, metavar="N", help=f"session ids whose highest epoch is remembered besides the live sessions' (default {DEFAULTS['fence_ids']}); past N the lowest epoch is forgotten and the daemon's epoch floor rises to it: a request for an id it does not know below the floor is refused stale_epoch (the reply names the floor), never admitted")
    parser.add_argument("--lifeline-fd", type=int, help="an inherited pipe's read end: the daemon shuts down when it reaches end-of-file, i.e. when the program that started it is gone (kvpool's launcher passes it)")
    parser.add_argument("--spill-budget", help="bytes of parked sessions' saved states kept in memory (the warm tier): an evicted or parked session is restored exactly by its next append instead of a cache miss; 0 turns the tier off (default: equal to --budget)")
    parser.add_argument("--park-after", type=float, help=f"park a session idle this many seconds even when nobody needs its place; 0: only when its place is needed (default {DEFAULTS['park_after_s']:g})")
    parser.add_argument("--persist-after", type=float, metavar="S", help="with --spill-dir: write a copy of a hot session's state to the disk tier once it has been idle S seconds (it stays hot; written again after it grows): after a crash the next daemon adopts it, and the router replays only the tokens since (default: never)")
    parser.add_argument("--spill-dir", type=pathlib.Path, help="the disk tier: a private directory (created 0700; a symlink or a directory others can write is refused) for saved states pushed out of memory; the store's own files of an earlier run are deleted at start, nothing else (needs --spill-disk-budget)")
    parser.add_argument("--spill-disk-budget", help="bytes of saved states kept in --spill-dir")
    parser.add_argument("--no-direct", dest="direct", action="store_false", default=None, help="no direct channels: every append goes through the supervisor (by default a client that asks gets its session's worker's channel, and its appends skip the supervisor)")
    parser.add_argument("--mode", choices=("process", "batched", "auto"), help=f"process: one worker process per session (each its own llama context); batched: each worker process holds --seqs-per-worker sessions as isolated sequences of one context and decodes the appends that arrive together in one batch, through the supervisor (no direct channels); auto: measure both schedules on this shard with --threads at start-up (a few seconds) and run the faster (`kvpool status` says which and why) (default {DEFAULTS['mode']})")
    parser.add_argument("--seqs-per-worker", type=int, metavar="N", help=f"batched mode: sessions per worker process; must divide --max-sessions (default {DEFAULTS['seqs_per_worker']})")
    parser.add_argument("--handshake-timeout", type=float, metavar="S", help=f"a connection whose Hello has not arrived whole S seconds after it connected is closed (default {DEFAULTS['handshake_timeout_s']:g})")
    parser.add_argument("--frame-timeout", type=float, metavar="S", help=f"a frame must arrive whole within S seconds of its first byte, or its connection is closed; a connection idle between frames stays open (default {DEFAULTS['frame_timeout_s']:g})")
    parser.add_argument("--max-buffered-bytes", help=f"request bytes held across all connections: a frame that does not fit waits, unread, for room (default {format_bytes(DEFAULT_MAX_BUFFERED_BYTES)}, at least --max-request-bytes)")
    parser.add_argument("--max-connections", type=int, metavar="N", help="open connections at most; one more is answered over_budget and closed (default: what the open-files limit leaves, at most 1024)")
    parser.add_argument("--drain-timeout", type=float, metavar="S", help=f"on SIGTERM (or `kvpool status --drain`) the daemon drains: new requests are answered draining (a client sends them again to the daemon that takes over the socket), requests in flight get S seconds to finish, appends still computing then are cancelled, every hot session is parked (to --spill-dir when given, so the states outlast the process), then it exits 0; a second SIGTERM or a SIGINT stops at once (exit 1); SIGINT before a drain stops at once (default {DEFAULTS['drain_timeout_s']:g})")
    parser.add_argument("--export-chunk-bytes", help=f"state bytes per Exported reply: an export travels in chunks of this size (default {format_bytes(DEFAULTS['export_chunk_bytes'])}, at least 1KiB)")
    parser.add_argument("--max-import-bytes", help=f"the largest state an Import may carry, and the bytes all imports in progress may hold together (default {format_bytes(DEFAULTS['max_import_bytes'])}); an import must fit the spill store too")
    parser.add_argument("--memory-margin", help=f"recycle an idle worker whose measured memory exceeds its charge by this (default {format_bytes(DEFAULTS['memory_margin_bytes'])})")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    parser.add_argument("--flash-attn", action="store_true", default=None, help="use flash attention (all shards of a route must agree)")
    parser.add_argument("--n-gpu-layers", type=int, help=f"layers to offload to a GPU build of llama.cpp (default {DEFAULTS['n_gpu_layers']})")
    parser.add_argument("--verbose", action="store_true", default=None, help="show llama.cpp's log")


# command-line option -> (ServeConfig field, conversion); an option not given keeps the field's default
OPTIONS = {
    "budget": ("budget_bytes", parse_bytes),
    "max_sessions": ("max_sessions", int),
    "ttl": ("ttl_s", float),
    "threads": ("threads", int),
    "threads_per_worker": ("threads_per_worker", int),
    "n_ctx": ("n_ctx", int),
    "max_request_bytes": ("max_request_bytes", parse_bytes),
    "request_timeout": ("request_timeout_s", float),
    "housekeeping_interval": ("housekeeping_interval_s", float),
    "min_residency": ("min_residency_s", float),
    "admit_queue": ("admit_queue_limit", int),
    "fence_ids": ("fence_ids", int),
    "memory_margin": ("memory_margin_bytes", parse_bytes),
    "spill_budget": ("spill_budget_bytes", lambda text: 0 if text.strip() == "0" else parse_bytes(text)),
    "park_after": ("park_after_s", float),
    "persist_after": ("persist_after_s", float),
    "spill_dir": ("spill_dir", pathlib.Path.absolute),
    "spill_disk_budget": ("spill_disk_budget_bytes", parse_bytes),
    "metrics_port": ("metrics_port", int),
    "flash_attn": ("flash_attn", bool),
    "n_gpu_layers": ("n_gpu_layers", int),
    "verbose": ("verbose", bool),
    "direct": ("direct", bool),
    "mode": ("mode", str),
    "seqs_per_worker": ("seqs_per_worker", int),
    "handshake_timeout": ("handshake_timeout_s", float),
    "frame_timeout": ("frame_timeout_s", float),
    "max_buffered_bytes": ("max_buffered_bytes", parse_bytes),
    "max_connections": ("max_connections", int),
    "drain_timeout": ("drain_timeout_s", float),
    "export_chunk_bytes": ("export_chunk_bytes", parse_bytes),
    "max_import_bytes": ("max_import_bytes", parse_bytes),
}


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    model = args.model or bundled_model_path()
    socket_path = args.socket or work_dir() / "run" / f"{model.stem}.sock"
    given = {field: convert(getattr(args, option)) for option, (field, convert) in OPTIONS.items() if getattr(args, option) is not None}
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

"""`kvpool serve`: run the shard daemon in the foreground until SIGTERM, SIGINT or a shutdown request."""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys

from kvpool.bundled import BundledModelMissing, bundled_model_path
from kvpool.config import ServeConfig, available_cores, parse_bytes, work_dir
from kvpool.lifeline import watch_lifeline
from kvpool.pool import WorkerStartFailed
from kvpool.segments import SharedMemoryTooSmall
from kvpool.server import SocketSetupError
from kvpool.shard_error import ShardError
from kvpool.supervisor import Supervisor


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "serve",
        help="serve one shard's per-session KV caches over a Unix socket",
        description=(
            "Run a shard daemon: a supervisor and a pool of warm worker processes, each holding the shard "
            "and at most one bounded llama context bound to one (route_session_id, route_epoch). Sessions "
            "are admitted against a byte budget, evicted least-recently-used when idle, and expire after "
            "--ttl seconds idle. Stop with SIGTERM, Ctrl-C or `kvpool status --shutdown`."
        ),
    )
    parser.add_argument("--model", type=pathlib.Path, help="shard GGUF to serve (default: the whole bundled model)")
    parser.add_argument("--socket", type=pathlib.Path, help="Unix socket path (default: <work dir>/run/<model>.sock); its directory must be yours and private")
    parser.add_argument("--budget", default="1GiB", help="bytes all sessions' contexts may reserve, e.g. 1GiB, 512MiB (default 1GiB)")
    parser.add_argument("--max-sessions", type=int, default=4, help="live sessions at most = warm worker processes (default 4)")
    parser.add_argument("--ttl", type=float, default=300.0, help="seconds an idle session lives (default 300)")
    parser.add_argument("--threads", type=int, default=available_cores(), help=f"llama threads computing at once across all workers (default: cores available, {available_cores()})")
    parser.add_argument("--threads-per-worker", type=int, default=1, help="llama threads per worker (default 1)")
    parser.add_argument("--n-ctx", type=int, default=2048, help="largest (and default) context per session (default 2048)")
    parser.add_argument("--max-request-bytes", default="64MiB", help="largest request frame accepted (default 64MiB)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a worker may take to answer one call (an append of --n-ctx rows included); a worker that does not is killed and replaced, and its request answered worker_lost (default 600)")
    parser.add_argument("--housekeeping-interval", type=float, default=0.5, help="seconds between housekeeping passes: TTL expiry, replacing dead idle workers, memory checks (default 0.5)")
    parser.add_argument("--lifeline-fd", type=int, help="an inherited pipe's read end: the daemon shuts down when it reaches end-of-file, i.e. when the program that started it is gone (kvpool's launcher passes it)")
    parser.add_argument("--memory-margin", default="64MiB", help="recycle an idle worker whose measured memory exceeds its charge by this (default 64MiB)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    parser.add_argument("--flash-attn", action="store_true", help="use flash attention (all shards of a route must agree)")
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="layers to offload to a GPU build of llama.cpp (default 0)")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    model = args.model or bundled_model_path()
    socket_path = args.socket or work_dir() / "run" / f"{model.stem}.sock"
    return ServeConfig(
        model=model.resolve(),
        socket=socket_path.absolute(),
        budget_bytes=parse_bytes(args.budget),
        max_sessions=args.max_sessions,
        ttl_s=args.ttl,
        threads=args.threads,
        threads_per_worker=args.threads_per_worker,
        n_ctx=args.n_ctx,
        flash_attn=args.flash_attn,
        max_request_bytes=parse_bytes(args.max_request_bytes),
        request_timeout_s=args.request_timeout,
        housekeeping_interval_s=args.housekeeping_interval,
        memory_margin_bytes=parse_bytes(args.memory_margin),
        metrics_port=args.metrics_port,
        n_gpu_layers=args.n_gpu_layers,
        verbose=args.verbose,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        if not config.model.is_file():
            raise ShardError(f"model file not found: {config.model}")
        supervisor = Supervisor(config)
        if args.lifeline_fd is not None:
            watch_lifeline(args.lifeline_fd, socket_path=config.socket)
        asyncio.run(supervisor.run())
    except (ValueError, ShardError, BundledModelMissing, SocketSetupError, SharedMemoryTooSmall, WorkerStartFailed, OSError) as error:
        print(f"kvpool serve: error: {error}", file=sys.stderr)
        return 2
    return 0

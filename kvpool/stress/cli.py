"""Command line of `kvpool stress` and scripts/stress_four_sessions.py: arguments, options, run, main."""

from __future__ import annotations

import argparse
import pathlib
import sys

from kvpool.client.client import ConnectionLost
from kvpool.host import format_bytes, parse_bytes
from kvpool.launcher import DaemonStartFailed
from kvpool.shard.bundled import BundledModelMissing
from kvpool.shard.errors import ShardError
from kvpool.stress.options import SHARED_PREFIX_BLOCK, SHARED_PREFIX_CACHE_BYTES, SHARED_PREFIX_SESSIONS, StressOptions
from kvpool.stress.report import render
from kvpool.stress.runner import Say, run_stress, say_on_stderr

# ---- command line ---------------------------------------------------------------------------------------


DESCRIPTION = (
    "Start a chain of `kvpool serve` daemons on the bundled model (or attach to running ones with --sockets) "
    "and drive N concurrent sessions through it with a seeded random mix of chunked prefill, greedy decode, "
    "truncate then replay, cancel in the middle of a long prefill (on each daemon) and after it completed, release and re-open, an epoch bump and a "
    "stale-epoch request. Every session's operations are then replayed alone on a fresh chain of daemons: every "
    "output row, greedy token and the final logits must be bit-identical, or the run fails (exit code 1). "
    "Scenario flags add faults (each bounded by operations, not time; --restart and --persist-after give the daemons a disk tier and check "
    "the durability contract: a drain loses no session, a crash costs only the tail); after each run every daemon must have "
    "released everything, balanced its books and returned its workers' memory within --uss-tolerance, and no process or "
    "shared-memory segment of the daemons may outlive them. --shared-prefix runs sessions whose prompts share prefixes through "
    "daemons with a prefix store: new sessions start from a stored prefix, every one exact, the hits reported. What timing "
    "did not let a run exercise is listed as a warning, not a failure. Progress goes to stderr, the table to stdout."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, help="concurrent sessions (default 4; 8 with --spill, 6 with --shared-prefix)")
    parser.add_argument("--ops", type=int, default=40, help="operations per session before the closing decodes (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every session's operations (default 0)")
    parser.add_argument("--budget-for", type=int, metavar="K", help="scenario: a budget for K sessions on each daemon (K + 0.5 times one session's measured charge), --sessions active: LRU evictions, cache_miss, replay; reserved bytes never above the limit")
    parser.add_argument("--min-residency", type=float, metavar="SECONDS", help="the daemons' --min-residency: an idle session used within it is not evicted to admit another (default: the daemons' own, derived from their measured step; 0: plain LRU)")
    parser.add_argument("--spill", action="store_true", help="scenario: the warm tier: --sessions (default 8) through daemons holding 2 contexts each (--max-sessions 2) with a spill budget large enough: every eviction parks the session's state and its next append restores it: zero cache misses, every session exact")
    parser.add_argument("--ttl", type=float, metavar="SECONDS", help="scenario: daemons expire sessions idle this long; each session idles once and must get cache_miss/expired")
    parser.add_argument("--kill-worker", action="store_true", help="scenario: SIGKILL the worker of one session on one daemon mid-decode; it must report worker_lost and recover by replay, the others continue exactly")
    parser.add_argument("--kill-supervisor", action="store_true", help="scenario: SIGKILL one daemon's supervisor mid-run; its processes must all exit (waited for under a hang guard that reports progress) and its /dev/shm segments be removed; the daemon is restarted on the same socket, every session that lost its connection replays from 0 at a new epoch, all stay exact (with --persist-after: only the tail since each copy)")
    parser.add_argument("--persist-after", type=float, metavar="S", help="the daemons get a disk tier (--spill-dir, one each) and --persist-after S: a hot session idle S seconds is copied to disk. With --kill-supervisor the killed session first waits idle for its copy and is killed 2 decodes later; the restarted daemon (same socket and spill dir) adopts every copy, and the router replays only the tokens since: the run fails if a session whose copy was adopted replays from 0; the tail replays and their total length are reported")
    parser.add_argument("--restart", action="store_true", help="scenario: a rolling restart; the daemons get a disk tier (--spill-dir, one each); daemon 0, 1, ... is drained in turn (SIGTERM) once 1/(n+1), 2/(n+1), ... of the operations are done and a new daemon started on its socket and spill dir, which adopts the parked sessions; the clients wait for it and send again what the old one took nothing of. Fails unless every daemon drained with exit 0, no session replayed from 0, some append was answered restored: true and every session is exact; the drain and restart times and the restores are reported")
    parser.add_argument("--stall-worker", action="store_true", help="scenario: SIGSTOP the worker of one session on one daemon (started with --request-timeout, see --stall-timeout) just before an append; the append must answer worker_lost once the timeout passes, the worker be killed and replaced, the others continue exactly")
    parser.add_argument("--stall-timeout", type=float, default=30.0, metavar="SECONDS", help="--request-timeout of the daemon whose worker --stall-worker stops (default 30: far above that daemon's largest worker call, its start-up calibration, on a slow busy machine)")
    parser.add_argument("--slow-reader", action="store_true", help="scenario: one connection sends appends to the last daemon (all-row logits, 3 MiB replies) and never reads a reply; the daemon's memory must stay bounded (backpressure) while the other sessions continue exactly")
    parser.add_argument("--replan", action="store_true", help="scenario: a second chain of daemons is started on the same model cut into --replan-parts shards at other split points; every session's route is re-planned onto it at a third of its operations and back at two thirds (kvpool.router.Router.replan: each daemon's state exported, re-sliced for the new split, imported under epoch + 1). Every re-plan of a session holding tokens must move it (no replay), every session stay exact, and the second chain hold nothing at the end")
    parser.add_argument("--replan-parts", type=int, metavar="P", help="--replan's second chain: P shards (default --parts + 1; 1: the whole model in one daemon)")
    parser.add_argument("--shared-prefix", action="store_true", help="scenario: shared prefixes; --sessions (default 6) whose prompts begin with one of a few system prompts of random lengths (whole, or cut at a random length inside a block) or with none, on daemons holding 2 contexts each (evictions park sessions in the warm tier) with a prefix store on (--prefix-block, --prefix-cache-budget: small, so it evicts entries), under the usual cancels, truncates, releases and epoch bumps. The router starts each fresh session from the longest prefix every daemon stores (a session sharing a block with an earlier one starts after that one's first append); each session's first append is its whole prompt and every other prefill chunk has two rows or more (a one-row append gives other bits here), and the run alone computes each prompt in one chunk. Fails unless some session started from a stored prefix, every daemon admitted what the router reused and every session is exact; the router's prefix_hits, prefix_hit_tokens and prefix_fallbacks and every daemon's prefix counters and store are reported")
    parser.add_argument("--prefix-block", type=int, metavar="N", help=f"--shared-prefix: the daemons' --prefix-block, tokens per block (default {SHARED_PREFIX_BLOCK})")
    parser.add_argument("--prefix-cache-budget", metavar="BYTES", help=f"--shared-prefix: the daemons' --prefix-cache-budget (default {format_bytes(SHARED_PREFIX_CACHE_BYTES)}: a few prompts' entries, so entries are evicted)")
    parser.add_argument("--sockets", help="comma-separated daemon sockets, first shard to last: attach instead of starting daemons")
    parser.add_argument("--model", type=pathlib.Path, help="source GGUF to cut into shards (default: the bundled model)")
    parser.add_argument("--parts", type=int, default=3, help="shards, one daemon each (default 3)")
    parser.add_argument("--n-ctx", type=int, default=512, help="context per session (default 512)")
    parser.add_argument("--reference", choices=("daemon", "local"), default="daemon", help="run alone on a fresh chain of daemons (default) or in process")
    parser.add_argument("--final-tokens", type=int, default=4, help="greedy tokens every session decodes at the end (default 4)")
    parser.add_argument("--sample-interval", type=float, default=0.1, help="seconds between stats samples of every daemon (default 0.1)")
    parser.add_argument("--mode", choices=("process", "batched"), default="process", help="the daemons' --mode: process (a worker process per session) or batched (one worker process per daemon holds every session as a sequence of one context; default process)")
    parser.add_argument("--uss-tolerance", default="48MiB", help="how far a worker's USS may end from its pre-run value, or from its own baseline if it was started during the run (default 48MiB: below the daemon's 64MiB recycle margin)")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write the raw figures (operations, latencies, errors, samples, verdicts) as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def options_from(args: argparse.Namespace) -> StressOptions:
    if not args.shared_prefix and (args.prefix_block is not None or args.prefix_cache_budget is not None):
        raise ValueError("--prefix-block and --prefix-cache-budget configure the daemons of --shared-prefix: pass --shared-prefix")
    sockets = tuple(pathlib.Path(part) for part in args.sockets.split(",") if part) if args.sockets else ()
    return StressOptions(
        sessions=args.sessions if args.sessions is not None else (8 if args.spill else SHARED_PREFIX_SESSIONS if args.shared_prefix else 4), spill=args.spill, ops=args.ops, seed=args.seed, budget_for=args.budget_for,
        min_residency_s=args.min_residency, ttl_s=args.ttl,
        kill_worker=args.kill_worker, kill_supervisor=args.kill_supervisor, stall_worker=args.stall_worker, slow_reader=args.slow_reader,
        restart=args.restart, persist_after_s=args.persist_after,
        stall_timeout_s=args.stall_timeout, sockets=sockets, model=args.model, parts=args.parts, n_ctx=args.n_ctx,
        reference=args.reference, final_tokens=args.final_tokens, sample_interval_s=args.sample_interval,
        uss_tolerance_bytes=parse_bytes(args.uss_tolerance), json_path=args.json, progress=not args.quiet, mode=args.mode,
        replan=args.replan, replan_parts=args.replan_parts,
        shared_prefix=args.shared_prefix, prefix_block=args.prefix_block if args.prefix_block is not None else SHARED_PREFIX_BLOCK,
        prefix_cache_bytes=parse_bytes(args.prefix_cache_budget) if args.prefix_cache_budget is not None else SHARED_PREFIX_CACHE_BYTES,
    )


def run(args: argparse.Namespace) -> int:
    """0: every verdict passed; 1: a verdict failed; 2: bad options or the run could not be set up."""
    try:
        options = options_from(args)
    except ValueError as error:
        print(f"kvpool stress: error: {error}", file=sys.stderr)
        return 2
    say: Say = say_on_stderr if options.progress else (lambda message: None)
    try:
        report = run_stress(options, say=say)
    except (DaemonStartFailed, ShardError, BundledModelMissing, ConnectionLost, OSError) as error:
        print(f"kvpool stress: error: {error}", file=sys.stderr)
        return 2
    print(render(report))
    if options.json_path is not None:
        say(f"raw figures written to {options.json_path}")
    return 0 if report.passed else 1


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("kvpool stress: interrupted", file=sys.stderr)
        return 130

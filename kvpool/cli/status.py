"""`kvpool status`: the session table and the budget of a running daemon."""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import msgspec

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.host import format_bytes
from kvpool.launcher import wait_answering
from kvpool.wire.protocol import BudgetRow, PrefixStoreRow, StatsReply

WAIT_PROGRESS_EVERY_S = 5.0
NOT_READY_EXIT = 1  # --wait-ready's timeout passed (2: any other failure)


def wait_seconds(text: str) -> float:
    """--wait-ready's TIMEOUT: seconds, a finite number >= 0 (0: one look)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"TIMEOUT must be a number of seconds >= 0, not {text!r}")
    return value


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "status",
        help="show a daemon's sessions, workers and budget",
        description="Print the session table (session, epoch, length, n_ctx, bytes, idle time, worker pid), the workers and the budget of a running `kvpool serve`.",
    )
    parser.add_argument("--socket", type=pathlib.Path, required=True, help="the daemon's Unix socket")
    parser.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--shutdown", action="store_true", help="ask the daemon to shut down at once after printing")
    stop.add_argument("--drain", action="store_true", help="ask the daemon to drain after printing, as on SIGTERM: new requests are answered draining, requests in flight finish (within its --drain-timeout), hot sessions are parked (to its --spill-dir), then it exits")
    parser.add_argument(
        "--wait-ready", type=wait_seconds, metavar="TIMEOUT",
        help=f"first wait up to TIMEOUT seconds for the daemon to answer on --socket (a daemon opens its socket once its start-up is done), "
        f"saying on stderr every {WAIT_PROGRESS_EVERY_S:g} s what it waits for; exit {NOT_READY_EXIT} with a one-line reason if it does not answer in time",
    )
    parser.set_defaults(func=run)


def _huge_pages_line(stats: StatsReply) -> str:
    held = sum(worker.huge_page_bytes for worker in stats.workers)
    return f"huge pages  {stats.huge_pages or 'n/a'}; the workers held {format_bytes(held)} in them when they became ready"


def render(stats: StatsReply) -> str:
    shard = stats.shard
    budget = stats.budget
    lines = [
        f"shard   {shard.shape}  {shard.model_path}",
        f"uptime  {stats.uptime_s:.0f} s   books: {stats.integrity}",
        f"mode    {stats.mode_detail or stats.mode}",
        _huge_pages_line(stats),
        f"threads {stats.threads_detail or 'n/a'}",
        f"keep warm {stats.keep_warm or 'n/a'}",
        f"budget  reserved {format_bytes(budget.reserved_bytes)} / limit {format_bytes(budget.limit_bytes)}   "
        + (f"spare contexts {format_bytes(budget.spare_bytes)}   " if budget.spare_bytes else "")
        + f"measured USS {format_bytes(budget.measured_uss_bytes)}"
        + (f"   VRAM {format_bytes(budget.measured_vram_bytes)}" if budget.measured_vram_bytes is not None else "   VRAM n/a (no GPU)"),
        _spill_line(budget),
        _prefix_line(stats.prefixes),
        "",
        f"{'SESSION':<24} {'EPOCH':>5} {'LENGTH':>6} {'N_CTX':>6} {'BYTES':>10} {'IDLE_S':>7} {'PID':>7} {'TIER':<4}  STATE",
    ]
    for row in stats.sessions:
        lines.append(
            f"{row.session_id[:24]:<24} {row.epoch:>5} {row.length:>6} {row.n_ctx:>6} {format_bytes(row.charged_bytes):>10} "
            f"{row.idle_s:>7.1f} {row.worker_pid:>7} {row.tier:<4}  {'busy' if row.in_flight else 'idle'}"
        )
    if not stats.sessions:
        lines.append("(no sessions)")
    lines += ["", f"{'WORKER':<18} {'PID':>7} {'STATE':<6} {'USS':>10} {'BASELINE':>10}  SESSION"]
    for worker in stats.workers:
        lines.append(
            f"{worker.name:<18} {worker.pid:>7} {worker.state:<6} {format_bytes(worker.uss_bytes):>10} "
            f"{format_bytes(worker.baseline_uss_bytes):>10}  {worker.session_id}"
        )
    if stats.calibration:
        lines += ["", f"{'PROBED N_CTX':<18} {'FULL COST':>10} {'CHARGED':>10} {'THEORY KV':>10}  (start-up probe; every other n_ctx is fitted)"]
        for row in stats.calibration:
            lines.append(
                f"{row.n_ctx:<18} {format_bytes(row.measured_bytes):>10} {format_bytes(row.charged_bytes):>10} "
                f"{format_bytes(row.theoretical_kv_bytes):>10}" + ("  extrapolated" if row.extrapolated else "")
            )
    counters = "  ".join(f"{name}={value}" for name, value in sorted(stats.counters.items()) if value)
    lines += ["", f"counters  {counters or '(none yet)'}"]
    return "\n".join(line.rstrip() for line in lines)


def _prefix_line(prefixes: PrefixStoreRow | None) -> str:
    if prefixes is None:
        return "prefix  off (--prefix-cache-budget 0, or the warm tier off)"
    return (
        f"prefix  {prefixes.entries} entries, {prefixes.blocks} blocks of {prefixes.block} tokens, "
        f"{format_bytes(prefixes.bytes)} / {format_bytes(prefixes.limit_bytes)}   "
        f"hits {prefixes.hits} ({prefixes.hit_tokens} positions not computed)   evictions {prefixes.evictions}"
    )


def _spill_line(budget: BudgetRow) -> str:
    if not budget.spill_limit_bytes:
        return "spill   off (--spill-budget 0)"
    line = f"spill   memory {format_bytes(budget.spill_bytes)} / {format_bytes(budget.spill_limit_bytes)}"
    if budget.spill_disk_limit_bytes:
        line += f"   disk {format_bytes(budget.spill_disk_bytes)} / {format_bytes(budget.spill_disk_limit_bytes)}"
    return line


def wait_ready(socket_path: pathlib.Path, timeout_s: float) -> str | None:
    """None once the daemon answers; else the one-line reason it did not within `timeout_s`."""

    def progress(waited_s: float, reason: str) -> None:
        print(f"kvpool status: waiting for {socket_path} ({waited_s:.0f} s of {timeout_s:g}): {reason}", file=sys.stderr, flush=True)

    reason = wait_answering(socket_path, timeout_s, progress_every_s=WAIT_PROGRESS_EVERY_S, progress=progress)
    return None if reason is None else f"no daemon answered on {socket_path} within {timeout_s:g} s: {reason}"


def run(args: argparse.Namespace) -> int:
    if args.wait_ready is not None:
        not_ready = wait_ready(args.socket, args.wait_ready)
        if not_ready is not None:
            print(f"kvpool status: {not_ready}", file=sys.stderr)
            return NOT_READY_EXIT
    try:
        with Client(args.socket, timeout_s=30) as client:
            stats = client.stats()
            print(msgspec.json.format(msgspec.json.encode(stats)).decode() if args.json else render(stats))
            if args.shutdown or args.drain:
                client.shutdown(drain=args.drain)
                print("drain requested" if args.drain else "shutdown requested", file=sys.stderr)
    except (ConnectionLost, KvpoolError) as error:
        print(f"kvpool status: error: {error}", file=sys.stderr)
        return 2
    return 0

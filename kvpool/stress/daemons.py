"""The daemons under test: the chain (started here, or attached to), their flags, and the charge probe."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence

from kvpool.host import format_bytes
from kvpool.launcher import Daemon, start_daemons
from kvpool.router.route import Route
from kvpool.stress.options import DRAIN_TIMEOUT_S, SPILL_DISK_BUDGET, SPILL_PLACES, UNLIMITED_BUDGET, FaultKind, StressOptions
from kvpool.stress.plans import SessionPlan, fault_stage

Say = Callable[[str], None]


@dataclasses.dataclass(slots=True)
class Chain:
    """The daemons under test: started here (daemons set) or attached to (sockets only).

    `daemons[i]` is replaced when daemon i is restarted (--kill-supervisor, --restart); `serve_options[i]` are
    its flags, `spill_dirs[i]` its disk tier (--restart, --persist-after), which its successor adopts.
    """

    sockets: list[pathlib.Path]
    shard_paths: list[pathlib.Path]
    daemons: list[Daemon]
    charges: list[int]
    workers_expected: int | None
    serve_options: list[list[str]] = dataclasses.field(default_factory=list)
    spill_dirs: list[pathlib.Path] = dataclasses.field(default_factory=list)


def stop_all(daemons: Sequence[Daemon]) -> list[int]:
    return [daemon.stop() for daemon in reversed(daemons)][::-1]


def serve_options(options: StressOptions, *, max_sessions: int, budget: str, ttl_s: float, request_timeout_s: float | None = None) -> list[str]:
    flags = [
        "--threads", "1", "--n-ctx", str(options.n_ctx), "--max-sessions", str(max_sessions),
        "--budget", budget, "--ttl", f"{ttl_s:g}",
    ]
    if options.mode == "batched":
        flags += ["--mode", "batched", "--seqs-per-worker", str(max_sessions)]  # one worker process holds every session
    if not options.warm_tier:  # --replan imports into the warm tier; --restart parks there; --shared-prefix's store is part of it
        flags += ["--spill-budget", "0"]  # every other scenario exercises eviction as it was: a cache miss
    if options.shared_prefix:
        flags += ["--prefix-block", str(options.prefix_block), "--prefix-cache-budget", str(options.prefix_cache_bytes)]
    if request_timeout_s is not None:
        flags += ["--request-timeout", f"{request_timeout_s:g}"]
    # --spill checks that every daemon parks and restores: plain LRU unless --min-residency says otherwise, since with
    # residency the admission queue may hold sessions back on the first shard until a downstream daemon never holds
    # more sessions than places (seen once: spills per daemon [4, 1, 0], restores [2, 0, 0])
    residency_s = 0.0 if options.min_residency_s is None and options.spill else options.min_residency_s
    if residency_s is not None:
        flags += ["--min-residency", f"{residency_s:g}"]
    return flags


def disk_tier_options(options: StressOptions, spill_dir: pathlib.Path) -> list[str]:
    """The flags of a daemon of the chain under --restart or --persist-after: its own disk tier, kept by a
    drain (and by a crash, for what --persist-after wrote), adopted by the daemon started after it."""
    flags = ["--spill-dir", str(spill_dir), "--spill-disk-budget", SPILL_DISK_BUDGET, "--drain-timeout", f"{DRAIN_TIMEOUT_S:g}"]
    if options.persist_after_s is not None:
        flags += ["--persist-after", f"{options.persist_after_s:g}"]
    return flags


def probe_charges(shards: Sequence[pathlib.Path], socket_dir: pathlib.Path, options: StressOptions, prompt: Sequence[int]) -> list[int]:
    """One session's charge on each daemon, measured by admitting a probe session."""
    # a batched session's charge is its share of a context of every sequence: probe the run's shape
    places = options.sessions if options.mode == "batched" else 1
    daemons = start_daemons(shards, socket_dir, serve_options(options, max_sessions=places, budget=UNLIMITED_BUDGET, ttl_s=300), prefix="probe")
    try:
        clients = [daemon.client() for daemon in daemons]
        try:
            route = Route(clients)
            route.append("stress-probe", 1, 0, prompt)
            charges = [next(row.charged_bytes for row in client.stats().sessions) for client in clients]
            route.release("stress-probe", 1)
            return charges
        finally:
            for client in clients:
                client.close()
    finally:
        stop_all(daemons)


def open_chain(options: StressOptions, socket_dir: pathlib.Path, prompt: Sequence[int], say: Say, shard_paths: list[pathlib.Path], plans: Sequence[SessionPlan]) -> Chain:
    if options.sockets:
        return Chain(list(options.sockets), shard_paths, [], [], None)
    ttl = options.ttl_s if options.ttl_s is not None else 300.0
    charges: list[int] = []
    if options.budget_for is not None:
        say("measuring one session's charge on each daemon (probe daemons)")
        charges = probe_charges(shard_paths, socket_dir, options, prompt)
        budgets = [str(int(charge * (options.budget_for + 0.5))) for charge in charges]
        max_sessions = options.sessions
        say("charges " + ", ".join(format_bytes(c) for c in charges) + f": budgets for {options.budget_for} sessions " + ", ".join(format_bytes(int(b)) for b in budgets))
    else:
        budgets = [UNLIMITED_BUDGET] * len(shard_paths)
        max_sessions = options.sessions + 1  # a spare warm worker: a replaced or recycling worker evicts nobody
    if options.spill or options.shared_prefix:
        max_sessions = SPILL_PLACES
    if options.slow_reader:
        max_sessions += 1  # the slow reader's own session
    stalled = fault_stage(list(plans), FaultKind.STALL_WORKER)
    serve = [
        serve_options(options, max_sessions=max_sessions, budget=budget, ttl_s=ttl, request_timeout_s=options.stall_timeout_s if index == stalled else None)
        for index, budget in enumerate(budgets)
    ]
    spill_dirs = [socket_dir / f"spill{index}" for index in range(len(shard_paths))] if options.durable else []
    for flags, spill_dir in zip(serve, spill_dirs):
        flags += disk_tier_options(options, spill_dir)
    plain = serve_options(options, max_sessions=max_sessions, budget=budgets[0], ttl_s=ttl) + (disk_tier_options(options, socket_dir / "spillN") if options.durable else [])
    say(f"starting {len(shard_paths)} daemons: {' '.join(plain)}" + (f" (daemon {stalled}: --request-timeout {options.stall_timeout_s:g})" if stalled is not None else ""))
    daemons = start_daemons(shard_paths, socket_dir, serve, prefix="shard")
    return Chain([daemon.socket for daemon in daemons], shard_paths, daemons, charges, max_sessions, serve, spill_dirs)

"""Options of one stress run: StressOptions, the operation kinds and the constants shared by the modules."""

from __future__ import annotations

import dataclasses
import enum
import pathlib

MiB = 1024**2
UNLIMITED_BUDGET = "64GiB"  # scenarios without --budget-for: the budget is no constraint
SPILL_PLACES = 2  # --spill, --shared-prefix: contexts per daemon (--max-sessions), fewer than the sessions
# --ttl's idle sessions: idle at least this past the TTL (one housekeeping tick, 0.5 s: the daemon cannot have
# expired it sooner), then polled until the daemon has (kvpool.stress.probes.idle_until_expired).
IDLE_MARGIN_S = 0.5
# The disk tier of --restart and --persist-after: room for every session's state many times over.
SPILL_DISK_BUDGET = "4GiB"
# --drain-timeout of those daemons: a hang guard, far above any append in flight on a slow, busy machine,
# so a drain never cancels one (a cancelled append is the cancel drills' business).
DRAIN_TIMEOUT_S = 600.0
# --shared-prefix: blocks small enough that short prompts share some (the daemons' own default is 32), a prefix
# store of a few prompts' entries per daemon (an entry of a 3-way split's shard costs ~7.5 KiB per position of
# the bundled model: 2 MiB holds ~270 positions, a few prompts), so it evicts while sessions keep offering theirs
SHARED_PREFIX_BLOCK = 16
SHARED_PREFIX_CACHE_BYTES = 2 * MiB
SHARED_PREFIX_SESSIONS = 6


class OpKind(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    TRUNCATE = "truncate"
    CANCEL = "cancel"
    RELEASE = "release_reopen"
    EPOCH_BUMP = "epoch_bump"
    STALE = "stale_epoch"
    IDLE = "idle_expire"


FORCED_KINDS = (OpKind.TRUNCATE, OpKind.CANCEL, OpKind.RELEASE, OpKind.EPOCH_BUMP, OpKind.STALE)
LATE_CANCEL = -1  # a cancel target: sent to every daemon after the append completed (not a daemon index)


class FaultKind(enum.StrEnum):
    """A fault one session injects into one daemon, once, at a planned operation (a decode)."""

    KILL_WORKER = "kill_worker"
    KILL_SUPERVISOR = "kill_supervisor"
    STALL_WORKER = "stall_worker"


# ---- options ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StressOptions:
    """One stress run; validated on construction."""

    sessions: int = 4
    ops: int = 40  # operations per session, before the closing prefill + final_tokens decodes
    seed: int = 0
    budget_for: int | None = None  # budget = (budget_for + 0.5) x one session's measured charge, per daemon
    min_residency_s: float | None = None  # the daemons' --min-residency (None: their default, derived at start-up)
    ttl_s: float | None = None
    kill_worker: bool = False
    kill_supervisor: bool = False  # SIGKILL one daemon's supervisor mid-run; restart it on its socket
    restart: bool = False  # drain (SIGTERM) each daemon of the route in turn mid-run; a successor adopts its sessions
    persist_after_s: float | None = None  # the daemons' --persist-after (a disk tier): a crash costs only the tail
    stall_worker: bool = False  # SIGSTOP one session's worker mid-append, past the daemon's request timeout
    slow_reader: bool = False  # a connection that sends appends to the last daemon and never reads replies
    spill: bool = False  # the warm tier on, SPILL_PLACES contexts per daemon: evictions park and restore
    replan: bool = False  # every session re-planned onto a second chain cut elsewhere, then back (kvpool.stress.replans)
    replan_parts: int | None = None  # the second chain's shards (None: parts + 1)
    # prompts sharing prefixes (kvpool.stress.prefixes) through daemons with a prefix store and SPILL_PLACES contexts
    shared_prefix: bool = False
    prefix_block: int = SHARED_PREFIX_BLOCK  # the daemons' --prefix-block (with shared_prefix)
    prefix_cache_bytes: int = SHARED_PREFIX_CACHE_BYTES  # the daemons' --prefix-cache-budget (with shared_prefix)
    mode: str = "process"  # the daemons' --mode; batched: one worker process per daemon holds every session
    # --request-timeout of the daemon whose worker is stalled. It bounds every worker call of that daemon,
    # the start-up probe (one 512-row batch at n_ctx 512: ~1.1 s for 512 rows on one 10-layer shard on
    # a 2-core Xeon, more with three daemons starting at once beside CPU burners) and the 192-row
    # cancelled prefill included, so it is far above either on a slow, busy machine.
    stall_timeout_s: float = 30.0
    sockets: tuple[pathlib.Path, ...] = ()  # attach to running daemons instead of starting them
    model: pathlib.Path | None = None
    parts: int = 3
    n_ctx: int = 512
    reference: str = "daemon"  # "daemon": a fresh chain of daemons; "local": kvpool.local.chain.LocalChain
    final_tokens: int = 4
    sample_interval_s: float = 0.1
    # Measured here: a worker's USS ends up to ~30 MiB above its pre-run value after many context
    # create/free cycles (heap glibc keeps; malloc_trim(0) in the worker brings it to ~2 MiB). 48 MiB
    # stays below the daemon's own recycle margin (--memory-margin, 64 MiB by default).
    uss_tolerance_bytes: int = 48 * MiB
    json_path: pathlib.Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.sessions < 1:
            problems.append("--sessions must be at least 1")
        if self.ops < 0:
            problems.append("--ops must be >= 0")
        if self.budget_for is not None and self.budget_for < 1:
            problems.append("--budget-for must be at least 1")
        if self.ttl_s is not None and self.ttl_s <= 0:
            problems.append("--ttl must be positive")
        if self.parts < 2:
            problems.append("--parts must be at least 2 (a chain)")
        if self.n_ctx < 256:
            problems.append("--n-ctx must be at least 256 (prompt, generation and the cancelled prefill)")
        if self.reference not in ("daemon", "local"):
            problems.append("--reference must be 'daemon' or 'local'")
        if self.final_tokens < 1:
            problems.append("--final-tokens must be at least 1")
        if self.sample_interval_s <= 0:
            problems.append("--sample-interval must be positive")
        if self.mode not in ("process", "batched"):
            problems.append("--mode must be 'process' or 'batched'")
        if self.sockets and self.mode != "process":
            problems.append("--mode configures the daemons: it needs started daemons, not --sockets")
        if self.stall_timeout_s <= 0:
            problems.append("--stall-timeout must be positive")
        if self.min_residency_s is not None and self.min_residency_s < 0:
            problems.append("--min-residency must be >= 0")
        if self.sockets and (self.budget_for is not None or self.ttl_s is not None or self.min_residency_s is not None):
            problems.append("--budget-for, --ttl and --min-residency configure the daemons: they need started daemons, not --sockets")
        if self.sockets and (self.kill_supervisor or self.stall_worker):
            problems.append("--kill-supervisor and --stall-worker restart or configure the daemons: they need started daemons, not --sockets")
        if self.persist_after_s is not None and self.persist_after_s < 0:
            problems.append("--persist-after must be >= 0")
        if self.durable and self.sockets:
            problems.append("--restart and --persist-after configure and restart the daemons: they need started daemons, not --sockets")
        if self.durable and self.budget_for is not None:
            problems.append("--restart and --persist-after keep every session's state (a disk tier): not with --budget-for (evictions would park, not miss)")
        if self.restart and self.kill_supervisor:
            problems.append("--restart and --kill-supervisor are two drills: run them one at a time")
        if self.replan and (self.sockets or self.may_lose_state or self.faults):
            problems.append("--replan starts a second chain of daemons and needs every session's state kept: not with --sockets, --budget-for, --ttl, --kill-worker, --kill-supervisor or --stall-worker")
        if self.replan and self.ops < 3:
            problems.append("--replan needs --ops >= 3 (a session re-plans at a third and at two thirds of its operations)")
        if self.replan_parts is not None and (self.replan_parts < 1 or self.replan_parts == self.parts):
            problems.append("--replan-parts must be at least 1 (1: the whole model in one daemon) and differ from --parts")
        if self.durable and self.replan:
            problems.append("--restart and --persist-after are not drills of --replan: run them one at a time")
        if self.shared_prefix and (self.sockets or self.spill or self.replan or self.durable or self.slow_reader or self.may_lose_state or self.faults):
            problems.append("--shared-prefix starts its own daemons with the warm tier on and checks every reuse against a reference that computes each "
                            "prompt in one chunk: not with --sockets, --spill, --replan, --restart, --persist-after, --slow-reader, --budget-for, --ttl or a fault drill")
        if not 1 <= self.prefix_block <= self.n_ctx // 4:
            problems.append("--prefix-block must be in [1, n_ctx / 4]")
        if self.prefix_cache_bytes < 1:
            problems.append("--prefix-cache-budget must be positive")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def second_parts(self) -> int:
        """--replan's second chain: --replan-parts shards, or one more than --parts."""
        return self.replan_parts if self.replan_parts is not None else self.parts + 1

    @property
    def scenario(self) -> str:
        parts = []
        if self.mode != "process":
            parts.append(self.mode)
        if self.budget_for is not None:
            parts.append(f"budget-for-{self.budget_for}")
        if self.min_residency_s is not None:
            parts.append(f"min-residency-{self.min_residency_s:g}")
        if self.ttl_s is not None:
            parts.append(f"ttl-{self.ttl_s:g}")
        if self.kill_worker:
            parts.append("kill-worker")
        if self.kill_supervisor:
            parts.append("kill-supervisor")
        if self.restart:
            parts.append("restart")
        if self.persist_after_s is not None:
            parts.append(f"persist-after-{self.persist_after_s:g}")
        if self.stall_worker:
            parts.append("stall-worker")
        if self.slow_reader:
            parts.append("slow-reader")
        if self.spill:
            parts.append("spill")
        if self.replan:
            parts.append(f"replan-{self.parts}-{self.second_parts}")
        if self.shared_prefix:
            parts.append("shared-prefix")
        return "+".join(parts) or "default"

    @property
    def faults(self) -> tuple[FaultKind, ...]:
        wanted = ((self.kill_worker, FaultKind.KILL_WORKER), (self.kill_supervisor, FaultKind.KILL_SUPERVISOR), (self.stall_worker, FaultKind.STALL_WORKER))
        return tuple(kind for on, kind in wanted if on)

    @property
    def durable(self) -> bool:
        """The daemons have a disk tier (--spill-dir): a drain or a crash keeps what was written there."""
        return self.restart or self.persist_after_s is not None

    @property
    def may_lose_state(self) -> bool:
        """A session's state may vanish from a daemon without a request of its own (eviction, expiry, restart;
        in batched mode a killed worker process takes every session it held, the killed session's neighbours too)."""
        return self.budget_for is not None or self.ttl_s is not None or self.kill_supervisor or (self.kill_worker and self.mode == "batched")

    @property
    def warm_tier(self) -> bool:
        """The daemons under test keep the warm tier (and with it their prefix stores)."""
        return self.spill or self.replan or self.durable or self.shared_prefix

    @property
    def decode_cap(self) -> int:
        """Sessions stop decoding at this many tokens so the closing decodes always fit in n_ctx."""
        return self.n_ctx - self.final_tokens - 1

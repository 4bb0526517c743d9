"""Options of one stress run: StressOptions, the operation kinds and the constants shared by the modules."""

from __future__ import annotations

import dataclasses
import enum
import pathlib

MiB = 1024**2
UNLIMITED_BUDGET = "64GiB"  # scenarios without --budget-for: the budget is no constraint
IDLE_MARGIN_S = 1.5  # past the TTL: two housekeeping ticks (0.5 s each) and slack


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


# ---- options ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StressOptions:
    """One stress run; validated on construction."""

    sessions: int = 4
    ops: int = 40  # operations per session, before the closing prefill + final_tokens decodes
    seed: int = 0
    budget_for: int | None = None  # budget = (budget_for + 0.5) x one session's measured charge, per daemon
    ttl_s: float | None = None
    kill_worker: bool = False
    sockets: tuple[pathlib.Path, ...] = ()  # attach to running daemons instead of starting them
    model: pathlib.Path | None = None
    parts: int = 3
    n_ctx: int = 512
    reference: str = "daemon"  # "daemon": a fresh chain of daemons; "local": kvpool.chain.LocalChain
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
        if self.sockets and (self.budget_for is not None or self.ttl_s is not None):
            problems.append("--budget-for and --ttl configure the daemons: they need started daemons, not --sockets")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def scenario(self) -> str:
        parts = []
        if self.budget_for is not None:
            parts.append(f"budget-for-{self.budget_for}")
        if self.ttl_s is not None:
            parts.append(f"ttl-{self.ttl_s:g}")
        if self.kill_worker:
            parts.append("kill-worker")
        return "+".join(parts) or "default"

    @property
    def decode_cap(self) -> int:
        """Sessions stop decoding at this many tokens so the closing decodes always fit in n_ctx."""
        return self.n_ctx - self.final_tokens - 1

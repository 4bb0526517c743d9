"""`kvpool stress`: concurrent sessions through a chain of shard daemons, fault drills, and the exactness check.

N sessions (one thread each, one Client per daemon each) run a seeded random mix of operations through a
route of `kvpool serve` daemons: chunked prefill, greedy decode, truncate then replay, cancel in the
middle of a long prefill, release and re-open, an epoch bump, and a stale-epoch request. Each session
keeps a log of the operations that took effect; afterwards every log is replayed alone on a fresh chain
of daemons (or in process) and every returned row, every greedy token and the final logits must be
bit-identical. Any difference is cross-talk and fails the run.

Scenarios add faults: a byte budget for fewer sessions than are active (LRU eviction), a short TTL
(expiry), a SIGKILLed worker. After every run each daemon must hold no session of ours, have its
reserved bytes back where they were, balanced books, and its workers' measured memory back within a
stated tolerance.

The operations of each session are seeded; how the sessions' requests interleave is up to the scheduler,
so two runs with one seed issue the same operations per session but not in the same global order.
"""

from __future__ import annotations

from kvpool.stress.checks import (
    SETTLE_TIMEOUT_S,
    Chain,
    Snapshot,
)
from kvpool.stress.cli import (
    DESCRIPTION,
    add_arguments,
    build_parser,
    main,
    options_from,
    run,
)
from kvpool.stress.driver import (
    ADMIT_RETRY_S,
    BACKOFF_BASE_S,
    BACKOFF_MAX_DOUBLINGS,
    CANCEL_DELAY_MAX_S,
    JITTER_MAX_S,
    LATE_CANCEL_EVERY,
    MAX_REPLAYS_PER_RECOVERY,
    MIN_FILLER_ROWS,
    OP_WEIGHTS,
    PREFILL_CHUNKS,
    PREFILL_FIRST,
    CancelOutcome,
    ContractViolation,
    SessionDriver,
    SessionPlan,
    SessionSetup,
    StageFailed,
    build_plans,
)
from kvpool.stress.log import (
    DaemonReference,
    LocalReference,
    LogEntry,
    LoggedAppend,
    LoggedReset,
    LoggedTruncate,
    ReferenceChain,
    ReplayOutcome,
    replay_alone,
    row_digest,
)
from kvpool.stress.options import (
    FORCED_KINDS,
    IDLE_MARGIN_S,
    UNLIMITED_BUDGET,
    MiB,
    OpKind,
    StressOptions,
)
from kvpool.stress.recording import (
    Recorder,
    Sampler,
)
from kvpool.stress.report import (
    DaemonSummary,
    KillRecord,
    Latency,
    Sample,
    SessionSummary,
    StressReport,
    Verdict,
    WorkerMemory,
    render,
)
from kvpool.stress.runner import (
    FILLER_ROWS,
    FILLER_TEXT,
    PROGRESS_EVERY_S,
    PROMPTS,
    Say,
    run_stress,
)

__all__ = [
    "ADMIT_RETRY_S",
    "BACKOFF_BASE_S",
    "BACKOFF_MAX_DOUBLINGS",
    "CANCEL_DELAY_MAX_S",
    "CancelOutcome",
    "Chain",
    "ContractViolation",
    "DESCRIPTION",
    "DaemonReference",
    "DaemonSummary",
    "FILLER_ROWS",
    "FILLER_TEXT",
    "FORCED_KINDS",
    "IDLE_MARGIN_S",
    "JITTER_MAX_S",
    "KillRecord",
    "LATE_CANCEL_EVERY",
    "Latency",
    "LocalReference",
    "LogEntry",
    "LoggedAppend",
    "LoggedReset",
    "LoggedTruncate",
    "MAX_REPLAYS_PER_RECOVERY",
    "MIN_FILLER_ROWS",
    "MiB",
    "OP_WEIGHTS",
    "OpKind",
    "PREFILL_CHUNKS",
    "PREFILL_FIRST",
    "PROGRESS_EVERY_S",
    "PROMPTS",
    "Recorder",
    "ReferenceChain",
    "ReplayOutcome",
    "SETTLE_TIMEOUT_S",
    "Sample",
    "Sampler",
    "Say",
    "SessionDriver",
    "SessionPlan",
    "SessionSetup",
    "SessionSummary",
    "Snapshot",
    "StageFailed",
    "StressOptions",
    "StressReport",
    "UNLIMITED_BUDGET",
    "Verdict",
    "WorkerMemory",
    "add_arguments",
    "build_parser",
    "build_plans",
    "main",
    "options_from",
    "render",
    "replay_alone",
    "row_digest",
    "run",
    "run_stress",
]

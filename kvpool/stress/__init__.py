"""`kvpool stress`: concurrent sessions through a chain of shard daemons, fault drills, and the exactness check.

N sessions (one thread each, one Client per daemon each) run a seeded random mix of operations through a
route of `kvpool serve` daemons: chunked prefill, greedy decode, truncate then replay, cancel (landing in
the middle of a long prefill on each daemon of the route, and sent after an append completed), release
and re-open, an epoch bump, and a stale-epoch request. Each session keeps a log of the operations that
took effect; afterwards every log is replayed alone on a fresh chain of daemons (or in process) and every
returned row, every greedy token and the final logits must be bit-identical. Any difference is cross-talk
and fails the run.

Scenarios add faults, each bounded by operations: a byte budget for fewer sessions than are active (LRU
eviction), a short TTL (expiry), a SIGKILLed worker, a SIGKILLed supervisor (restarted on its socket), a
SIGSTOPped worker (the daemon's request timeout), and a connection that never reads its replies
(backpressure). After every run each daemon must hold no session of ours, have its reserved bytes back
where they were, balanced books, its workers' measured memory back within a stated tolerance, and no
process or shared-memory segment of the daemons may outlive them.

A run fails only when something ran and behaved wrongly; what timing did not let it exercise is listed
as a warning. The operations of each session are seeded; how the sessions' requests interleave is up to
the scheduler, so two runs with one seed issue the same operations per session but not in the same
global order.
"""

from __future__ import annotations

from kvpool.stress.cancels import CANCEL_ATTEMPTS, CancelDrill, CancelResult
from kvpool.stress.checks import SETTLE_TIMEOUT_S, DrillFacts, Snapshot
from kvpool.stress.cli import DESCRIPTION, add_arguments, build_parser, main, options_from, run
from kvpool.stress.daemons import Chain
from kvpool.stress.driver import (
    ADMIT_RETRY_S,
    BACKOFF_BASE_S,
    BACKOFF_MAX_DOUBLINGS,
    JITTER_MAX_S,
    MAX_REPLAYS_PER_RECOVERY,
    PREFILL_CHUNKS,
    SessionDriver,
)
from kvpool.stress.errors import ContractViolation, StageFailed
from kvpool.stress.faults import STALL_GRACE_S, FaultInjector
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
from kvpool.stress.options import FORCED_KINDS, IDLE_MARGIN_S, LATE_CANCEL, UNLIMITED_BUDGET, FaultKind, MiB, OpKind, StressOptions
from kvpool.stress.plans import PlannedFault, SessionPlan, SessionSetup, build_plans, cancel_targets
from kvpool.stress.processes import ORPHAN_DEADLINE_S
from kvpool.stress.recording import Recorder, Sampler
from kvpool.stress.report import (
    DaemonSummary,
    KillRecord,
    Latency,
    Sample,
    SessionSummary,
    SlowReaderRecord,
    StallRecord,
    StressReport,
    SupervisorKillRecord,
    Verdict,
    WorkerMemory,
    render,
)
from kvpool.stress.restarts import ChainControl
from kvpool.stress.runner import FILLER_ROWS, FILLER_TEXT, PROGRESS_EVERY_S, PROMPTS, Say, run_stress
from kvpool.stress.schedule import MIN_FILLER_ROWS, OP_WEIGHTS, PREFILL_FIRST, OpSchedule
from kvpool.stress.slow_reader import ROWS_PER_APPEND, RSS_BOUND_BYTES, SlowReader

__all__ = [
    "ADMIT_RETRY_S",
    "BACKOFF_BASE_S",
    "BACKOFF_MAX_DOUBLINGS",
    "CANCEL_ATTEMPTS",
    "CancelDrill",
    "CancelResult",
    "Chain",
    "ChainControl",
    "ContractViolation",
    "DESCRIPTION",
    "DaemonReference",
    "DaemonSummary",
    "DrillFacts",
    "FILLER_ROWS",
    "FILLER_TEXT",
    "FORCED_KINDS",
    "FaultInjector",
    "FaultKind",
    "IDLE_MARGIN_S",
    "JITTER_MAX_S",
    "KillRecord",
    "LATE_CANCEL",
    "Latency",
    "LocalReference",
    "LogEntry",
    "LoggedAppend",
    "LoggedReset",
    "LoggedTruncate",
    "MAX_REPLAYS_PER_RECOVERY",
    "MIN_FILLER_ROWS",
    "MiB",
    "ORPHAN_DEADLINE_S",
    "OP_WEIGHTS",
    "OpKind",
    "OpSchedule",
    "PREFILL_CHUNKS",
    "PREFILL_FIRST",
    "PROGRESS_EVERY_S",
    "PROMPTS",
    "PlannedFault",
    "ROWS_PER_APPEND",
    "RSS_BOUND_BYTES",
    "Recorder",
    "ReferenceChain",
    "ReplayOutcome",
    "SETTLE_TIMEOUT_S",
    "STALL_GRACE_S",
    "Sample",
    "Sampler",
    "Say",
    "SessionDriver",
    "SessionPlan",
    "SessionSetup",
    "SessionSummary",
    "SlowReader",
    "SlowReaderRecord",
    "Snapshot",
    "StageFailed",
    "StallRecord",
    "StressOptions",
    "StressReport",
    "SupervisorKillRecord",
    "UNLIMITED_BUDGET",
    "Verdict",
    "WorkerMemory",
    "add_arguments",
    "build_parser",
    "build_plans",
    "cancel_targets",
    "main",
    "options_from",
    "render",
    "replay_alone",
    "row_digest",
    "run",
    "run_stress",
]

"""What each session will do, seeded before the run: forced operations, cancel targets and faults."""

from __future__ import annotations

import dataclasses
import random

from kvpool.stress.options import FORCED_KINDS, LATE_CANCEL, FaultKind, OpKind, StressOptions


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedFault:
    """Inject `kind` into daemon `stage` on this session's first decode at or after op `from_op`."""

    kind: FaultKind
    stage: int
    from_op: int


@dataclasses.dataclass(frozen=True, slots=True)
class SessionPlan:
    """Which operations are forced at which op index, where the forced cancels go, and the faults.

    `cancel_targets` holds one target per forced cancel, in order: a daemon index (the cancel must land
    there, in the middle of the prefill) or LATE_CANCEL (sent to every daemon after the append completed).
    """

    forced: tuple[tuple[int, OpKind], ...]
    cancel_targets: tuple[int, ...] = ()
    faults: tuple[PlannedFault, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class SessionSetup:
    index: int
    session_id: str
    prompt: tuple[int, ...]
    filler: tuple[int, ...]
    plan: SessionPlan
    prompt_kind: str = ""  # --shared-prefix: which system prompt it begins with (kvpool.stress.prefixes)
    shared_tokens: int = 0  # --shared-prefix: the longest prefix its prompt shares with another session's
    follows: int | None = None  # --shared-prefix: the session whose first append it waits for before its first operation


def cancel_targets(options: StressOptions, n_stages: int) -> list[list[int]]:
    """Every target (each daemon mid-prefill, and the late cancel) goes to some session, round robin."""
    targets = [LATE_CANCEL, *range(n_stages)]
    offset = options.seed % len(targets)
    targets = targets[offset:] + targets[:offset]
    per_session: list[list[int]] = [[] for _ in range(options.sessions)]
    for position, target in enumerate(targets):
        per_session[position % options.sessions].append(target)
    rng = random.Random(f"cancels:{options.seed}")
    for assigned in per_session:
        if not assigned:  # more sessions than targets: any target
            assigned.append(rng.choice(targets))
    return per_session


def build_plans(options: StressOptions, n_stages: int) -> list[SessionPlan]:
    rng = random.Random(f"plans:{options.seed}")
    kill_victim = rng.randrange(options.sessions) if options.kill_worker else None
    fault_rng = random.Random(f"faults:{options.seed}")
    low = max(1, options.ops // 5)
    # The slow reader's connection goes to the last daemon: a supervisor kill spares that one.
    killable = n_stages - 1 if options.slow_reader and n_stages > 1 else n_stages
    others = {
        kind: (fault_rng.randrange(options.sessions), fault_rng.randrange(killable if kind is FaultKind.KILL_SUPERVISOR else n_stages),
               fault_rng.randrange(low, max(low + 1, options.ops // 2)))
        for kind in options.faults if kind is not FaultKind.KILL_WORKER
    }
    targets = cancel_targets(options, n_stages)
    plans = []
    for index in range(options.sessions):
        kinds = list(FORCED_KINDS) + ([OpKind.IDLE] if options.ttl_s is not None else [])
        kinds += [OpKind.CANCEL] * (len(targets[index]) - 1)  # FORCED_KINDS holds one cancel already
        rng.shuffle(kinds)
        slots = range(low, max(low + len(kinds), options.ops))
        positions = sorted(rng.sample(slots, len(kinds)))
        forced = tuple(zip(positions, kinds))
        faults = []
        if index == kill_victim:
            faults.append(PlannedFault(FaultKind.KILL_WORKER, rng.randrange(n_stages), rng.randrange(low, max(low + 1, options.ops // 2))))
        faults += [PlannedFault(kind, stage, from_op) for kind, (victim, stage, from_op) in others.items() if victim == index]
        plans.append(SessionPlan(forced, tuple(targets[index]), tuple(faults)))
    return plans


def fault_stage(plans: list[SessionPlan], kind: FaultKind) -> int | None:
    """The daemon a planned fault of `kind` targets (the run configures that daemon for it)."""
    return next((fault.stage for plan in plans for fault in plan.faults if fault.kind is kind), None)

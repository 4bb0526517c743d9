"""Which operation a session does next: the forced ones (at their planned op index, once applicable) and
the planned cancel targets first, else a seeded random choice; and what was left unexercised."""

from __future__ import annotations

import random
from collections import Counter

from kvpool.stress.cancels import CancelResult
from kvpool.stress.options import LATE_CANCEL, OpKind
from kvpool.stress.plans import SessionPlan
from kvpool.stress.state import SessionState

MIN_FILLER_ROWS = 64
MAX_CANCEL_REQUEUES = 3  # a cancel cut short by lost state (eviction, expiry, restart) is tried again later
OP_WEIGHTS = {
    OpKind.PREFILL: 0.5,  # and before any other, with probability PREFILL_FIRST, while tokens are pending
    OpKind.DECODE: 0.70,
    OpKind.TRUNCATE: 0.08,
    OpKind.CANCEL: 0.03,
    OpKind.RELEASE: 0.03,
    OpKind.EPOCH_BUMP: 0.03,
    OpKind.STALE: 0.08,
    OpKind.IDLE: 0.0,  # forced only
}
PREFILL_FIRST = 0.8


def target_name(target: int) -> str:
    return "late cancel (after completion, every daemon)" if target == LATE_CANCEL else f"mid-prefill cancel on daemon {target}"


def applicable(d: SessionState, kind: OpKind) -> bool:
    match kind:
        case OpKind.PREFILL:
            return d.length < len(d.tokens)
        case OpKind.DECODE:
            return d.logits is not None and d.length == len(d.tokens) < d.options.decode_cap
        case OpKind.TRUNCATE:
            return d.length >= 2
        case OpKind.CANCEL:
            return d.length > 0 and d.options.n_ctx - d.length - 1 >= MIN_FILLER_ROWS
        case OpKind.STALE | OpKind.EPOCH_BUMP:
            return d.length > 0  # state on every daemon: the bump must miss (new_epoch), stale must be refused
        case OpKind.IDLE:
            return d.options.ttl_s is not None and d.length > 0
    return True


class OpSchedule:
    def __init__(self, plan: SessionPlan, rng: random.Random, n_stages: int) -> None:
        self._forced = list(plan.forced)
        self._cancel_targets = list(plan.cancel_targets)
        self._rng = rng
        self._n_stages = n_stages
        self._requeued: Counter[int] = Counter()
        self._dropped: list[str] = []  # forced operations that never became applicable
        self.cancel_targets_missed: list[str] = []

    def choose(self, d: SessionState) -> OpKind:
        for position, (at, kind) in enumerate(self._forced):
            if at <= d.op_index and applicable(d, kind):
                del self._forced[position]
                return kind
        if applicable(d, OpKind.PREFILL) and self._rng.random() < PREFILL_FIRST:
            return OpKind.PREFILL
        kinds = [kind for kind, weight in OP_WEIGHTS.items() if weight > 0 and applicable(d, kind)]
        return self._rng.choices(kinds, [OP_WEIGHTS[kind] for kind in kinds])[0]

    @property
    def forced_pending(self) -> bool:
        return bool(self._forced)

    def next_forced(self, d: SessionState) -> OpKind | None:
        """At the end of the run: the first pending forced operation that applies, whatever its index.
        None (and the rest dropped, reported) when none applies (a cancel with no room left in n_ctx)."""
        position = next((i for i, (_at, kind) in enumerate(self._forced) if applicable(d, kind)), None)
        if position is not None:
            return self._forced.pop(position)[1]
        self.cancel_targets_missed += [target_name(t) for t in self._cancel_targets]
        self._cancel_targets.clear()
        self._dropped += [str(kind) for _at, kind in self._forced]
        self._forced.clear()
        return None

    def cancel_target(self) -> int:
        """A planned cancel target if one is pending, else a random one."""
        return self._cancel_targets.pop(0) if self._cancel_targets else self._rng.choice([LATE_CANCEL, *range(self._n_stages)])

    def cancel_done(self, target: int, result: CancelResult, op_index: int) -> None:
        """One cut short by lost state is planned again (bounded); one timing never let land is reported."""
        if result is CancelResult.INTERRUPTED and self._requeued[target] < MAX_CANCEL_REQUEUES:
            self._requeued[target] += 1
            self._cancel_targets.insert(0, target)
            self._forced.insert(0, (op_index + 1, OpKind.CANCEL))
        elif result is not CancelResult.EXERCISED:
            self.cancel_targets_missed.append(target_name(target))

    def unexercised(self) -> list[str]:
        return self._dropped + [str(kind) for _at, kind in self._forced]

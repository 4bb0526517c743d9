"""Operations that probe one rule of the contract each: an epoch bump must miss with new_epoch, a
stale-epoch request must be refused and change nothing, a session idle past the TTL must have expired."""

from __future__ import annotations

import sys
import time

import numpy as np

from kvpool.client.client import KvpoolError
from kvpool.stress.errors import ContractViolation
from kvpool.stress.options import IDLE_MARGIN_S
from kvpool.stress.state import SessionState
from kvpool.wire.protocol import ErrorCode, MissReason

EXPIRY_HANG_GUARD_S = 300.0  # past the TTL, waiting for the daemon to expire the session: far above its housekeeping tick
EXPIRY_PROGRESS_EVERY_S = 15.0
EXPIRY_POLL_S = 0.05


def bump_epoch(d: SessionState) -> None:
    """A re-planned route: epoch + 1. Its first request at position > 0 must miss (new_epoch); then the
    session starts again from 0 under the new epoch (releasing it everywhere drops the old one's state)."""
    epoch = d.epoch + 1
    if d.length > 0:
        try:
            d.clients[0].append(d.session_id, epoch, d.length, tokens=[d.tokens[0]])
        except KvpoolError as error:
            if error.code != ErrorCode.CACHE_MISS or error.reason != MissReason.NEW_EPOCH:
                raise ContractViolation(f"{d.session_id}: epoch {epoch} at position {d.length} answered {error}, expected cache_miss/new_epoch") from None
        else:
            raise ContractViolation(f"{d.session_id}: epoch {epoch} at position {d.length} was accepted without state")
    d.epoch = epoch
    d.start_over()


def stale_request(d: SessionState) -> None:
    """A request at epoch - 1 to one daemon: stale_epoch, and the session there unchanged."""
    stage = d.rng.randrange(len(d.clients))
    client = d.clients[stage]
    stale = d.epoch - 1
    kind = d.rng.choice(("append", "truncate", "release", "cancel"))
    # What the daemon holds is (epoch, length) unless the session may have lost it there (eviction, expiry, a killed
    # supervisor) or the router left a replay to the next append (a connection lost inside a truncate: the daemons it
    # did not reach hold more; a restarted one may hold less): then the stale request must leave it as it was.
    as_it_was = d.options.may_lose_state or not d.session.settled
    before = _row(d, stage)
    try:
        if kind == "append" and stage == 0:
            client.append(d.session_id, stale, d.length, tokens=[d.tokens[0]])
        elif kind == "append":
            client.append(d.session_id, stale, d.length, hidden=np.zeros((1, client.shard.shape.n_embd), np.float32))
        elif kind == "truncate":
            client.truncate(d.session_id, stale, 0)
        elif kind == "release":
            client.release(d.session_id, stale)
        else:
            client.cancel(d.session_id, stale)
    except KvpoolError as error:
        if error.code != ErrorCode.STALE_EPOCH:
            raise ContractViolation(f"{d.session_id}: stale {kind} (epoch {stale} < {d.epoch}) answered {error}") from None
    else:
        raise ContractViolation(f"{d.session_id}: stale {kind} (epoch {stale} < {d.epoch}) on daemon {stage} was accepted")
    row = _row(d, stage)
    if row is None and not d.options.may_lose_state and (before is not None or d.session.settled):  # it held it before, or a settled route says it does
        raise ContractViolation(f"{d.session_id}: gone from daemon {stage} after a stale {kind}")
    expected = before if before is not None and as_it_was else (d.epoch, d.length)
    if row is not None and row != expected:
        raise ContractViolation(f"{d.session_id}: stale {kind} changed daemon {stage}: epoch/length {row[0]}/{row[1]}, expected {expected[0]}/{expected[1]}")


def _row(d: SessionState, stage: int) -> tuple[int, int] | None:
    """(epoch, length) of the session on daemon `stage`, None when it holds none."""
    row = next((r for r in d.clients[stage].stats().sessions if r.session_id == d.session_id), None)
    return None if row is None else (row.epoch, row.length)


def idle_until_expired(d: SessionState) -> None:
    """Stay idle until daemon 0 has expired the session: it cannot before the TTL and a housekeeping tick,
    then its stats are polled until they no longer list it (the limit a hang guard that says where the wait
    stands, never a verdict on the machine's speed). The next request must then get cache_miss/expired (the
    router's next append then replays)."""
    assert d.options.ttl_s is not None
    idle_since = time.monotonic()
    time.sleep(d.options.ttl_s + IDLE_MARGIN_S)
    polled_since = time.monotonic()
    next_note = polled_since + EXPIRY_PROGRESS_EVERY_S
    while _row(d, 0) is not None:
        idle_s = time.monotonic() - idle_since
        if time.monotonic() - polled_since > EXPIRY_HANG_GUARD_S:
            d.idle_results.append("not expired")
            raise ContractViolation(f"{d.session_id}: still live on daemon 0 after {idle_s:.0f} s idle (ttl {d.options.ttl_s:g} s; "
                                    f"the hang guard: {EXPIRY_HANG_GUARD_S:g} s past it)")
        if d.options.progress and time.monotonic() >= next_note:
            next_note += EXPIRY_PROGRESS_EVERY_S
            print(f"kvpool stress: {d.session_id}: waiting for daemon 0 to expire it ({idle_s:.0f} s idle, ttl {d.options.ttl_s:g} s, "
                  f"hang guard {EXPIRY_HANG_GUARD_S:g} s)", file=sys.stderr, flush=True)
        time.sleep(EXPIRY_POLL_S)
    idle_s = time.monotonic() - idle_since
    if d.length < len(d.tokens):
        tokens = d.tokens[d.length : d.length + 1]
    else:
        assert d.logits is not None
        tokens = [int(np.argmax(d.logits))]
    try:
        d.clients[0].append(d.session_id, d.epoch, d.length, tokens=tokens)
    except KvpoolError as error:
        d.idle_results.append(f"{error.code}/{error.reason}" if error.reason else str(error.code))
        if error.code == ErrorCode.CACHE_MISS and error.reason == MissReason.EXPIRED:
            return
        raise ContractViolation(f"{d.session_id}: gone from daemon 0's stats after {idle_s:.1f} s idle, the next append answered {error}") from None
    d.idle_results.append("not expired")
    raise ContractViolation(f"{d.session_id}: gone from daemon 0's stats after {idle_s:.1f} s idle (ttl {d.options.ttl_s:g} s), yet its next append was served")

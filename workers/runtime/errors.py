"""Typed failures of the shard runtime. Each carries the session length after the failure."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import ErrorCode


class ShardRuntimeError(Exception):
    """Base class; `length` is the context's length after the failed call (nothing half-applied)."""

    code = "runtime_error"

    def __init__(self, message: str, *, length: int) -> None:
        super().__init__(message)
        self.length = length


class PositionMismatch(ShardRuntimeError):
    code = "position_mismatch"


class ContextFull(ShardRuntimeError):
    code = "context_full"


class BadInput(ShardRuntimeError):
    code = "bad_request"


class Cancelled(ShardRuntimeError):
    code = "cancelled"


class DecodeFailed(ShardRuntimeError):
    code = "decode_failed"


class RestoreFailed(ShardRuntimeError):
    code = "restore_failed"


_BY_WIRE_CODE: dict[ErrorCode, type[ShardRuntimeError]] = {
    ErrorCode.BAD_REQUEST: BadInput,
    ErrorCode.POSITION_MISMATCH: PositionMismatch,
    ErrorCode.CONTEXT_FULL: ContextFull,
}


@contextlib.contextmanager
def wire_checks(about: str = "") -> Iterator[None]:
    """Run the checks of kvpool.wire.checks (the one place an append's rules are written): the RequestFailed one
    raises leaves as this runtime's typed error of the same code, with its message (after `about`) and length."""
    try:
        yield
    except RequestFailed as failure:
        raise _BY_WIRE_CODE.get(failure.code, ShardRuntimeError)(f"{about}{failure}", length=failure.length) from None

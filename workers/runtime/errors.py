"""Typed failures of the shard runtime. Each carries the session length after the failure."""

from __future__ import annotations


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

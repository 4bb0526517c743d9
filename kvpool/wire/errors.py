"""RequestFailed: raised anywhere inside a request's handling, it becomes that request's typed ErrorReply."""

from __future__ import annotations

from kvpool.wire.protocol import ErrorCode, MissReason


class RequestFailed(Exception):
    def __init__(
        self, code: ErrorCode, message: str, *, length: int = 0, reason: MissReason | None = None, retry_after_s: float | None = None,
        epoch_floor: int = 0,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.length = length
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.epoch_floor = epoch_floor

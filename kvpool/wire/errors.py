"""RequestFailed: raised anywhere inside a request's handling, it becomes that request's typed ErrorReply;
and which error codes say the request was never carried out (a client may send it again)."""

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


# Codes whose reply says the daemon took nothing of the request: a client may send it again, to whatever
# daemon then serves the socket (kvpool.client). Every other error reply, and a reply lost on the way, may
# follow a request that took effect.
NEVER_CARRIED_OUT = frozenset({ErrorCode.DRAINING})


def never_carried_out(code: ErrorCode) -> bool:
    return code in NEVER_CARRIED_OUT

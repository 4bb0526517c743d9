"""What a call to a worker process raises: it refused (WorkerFailed), it is gone (WorkerLost), or it never
became ready (WorkerStartFailed)."""

from __future__ import annotations


class WorkerLost(Exception):
    """The worker process died or stopped answering; its context is gone."""


class WorkerStartFailed(Exception):
    pass


class WorkerFailed(Exception):
    """The worker refused a command; `code` names why (an ErrorCode value where one applies) and `length`
    is its context's length after the refusal."""

    def __init__(self, code: str, message: str, length: int) -> None:
        super().__init__(message)
        self.code = code
        self.length = length

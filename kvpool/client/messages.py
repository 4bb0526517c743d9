"""What a kvpool client sends and gets back, shared by the synchronous client (kvpool.client.client) and the
asyncio one (kvpool.client.aio): the append request and its options, the result of an append, and the
errors a request raises (a typed error reply: KvpoolError; a connection gone or answering nonsense:
ConnectionLost)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from kvpool.wire.protocol import (
    Append,
    AppendReply,
    ErrorCode,
    ErrorReply,
    MissReason,
    OutputRows,
    Reply,
    RequestMessage,
)
from kvpool.wire.sampling import Sampling


class KvpoolError(Exception):
    """A typed error reply from the daemon; `code`, `length` and (for cache_miss) `reason` say what."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code}: {reply.message}" + (f" (reason: {reply.reason})" if reply.reason else ""))
        self.reply = reply
        self.code: ErrorCode = reply.code
        self.length = reply.length
        self.reason: MissReason | None = reply.reason


class ConnectionLost(Exception):
    """The daemon closed the connection or could not be reached."""


@dataclass(frozen=True, slots=True)
class AppendResult:
    length: int
    rows: np.ndarray  # float32 [rows, width]: hidden states, or logits on the last shard
    admitted: bool
    restored: bool = False  # the session was parked; its saved state was restored for this append
    token: int | None = None  # with sample=: the token the last shard picked
    top_ids: tuple[int, ...] = ()  # with sample.logprobs: the most likely tokens and their log-probabilities
    top_logprobs: tuple[float, ...] = ()

    @classmethod
    def of(cls, reply: AppendReply) -> AppendResult:
        rows = np.frombuffer(reply.data, dtype="<f4").reshape(reply.rows, reply.width)
        return cls(
            length=reply.length, rows=rows, admitted=reply.admitted, restored=reply.restored,
            token=reply.token if reply.token >= 0 else None, top_ids=tuple(reply.top_ids), top_logprobs=tuple(reply.top_logprobs),
        )


class AppendOptions(TypedDict, total=False):
    """What an append carries besides the session and position: exactly one of tokens (first shard) and
    hidden (float32 [rows, n_embd], elsewhere); output_rows "last" or "all"; n_ctx and admit_timeout_s
    matter when the append admits a new session (0: the daemon's default; 0: answer over_budget at once)."""

    tokens: list[int] | np.ndarray | None
    hidden: np.ndarray | None
    output_rows: str
    n_ctx: int
    admit_timeout_s: float
    sample: Sampling | None


def append_request(
    session_id: str, epoch: int, start_pos: int, *, tokens: list[int] | np.ndarray | None = None, hidden: np.ndarray | None = None,
    output_rows: str = "last", n_ctx: int = 0, admit_timeout_s: float = 0.0, sample: Sampling | None = None, direct: bool = False,
) -> Append:
    return Append(
        session_id=session_id, epoch=epoch, start_pos=start_pos,
        tokens=None if tokens is None else [int(token) for token in tokens],
        hidden=None if hidden is None else np.ascontiguousarray(hidden, dtype="<f4").tobytes(),
        output_rows=OutputRows(output_rows), n_ctx=n_ctx, admit_timeout_s=admit_timeout_s, sample=sample, direct=direct,
    )


def checked_reply(request: RequestMessage, reply: Reply, expected: type) -> Reply:
    """The reply if it is of the expected type; an ErrorReply raises KvpoolError, anything else ConnectionLost."""
    if isinstance(reply, ErrorReply):
        raise KvpoolError(reply)
    if not isinstance(reply, expected):
        raise ConnectionLost(f"the daemon answered {type(request).__name__} with {type(reply).__name__}")
    return reply

"""What a kvpool client sends and gets back, shared by the synchronous client (kvpool.client.client) and the
asyncio one (kvpool.client.aio): one `Call` per request (the request, the reply that answers it and what the
caller gets of that reply), the options and the result of an append, and the errors a request raises (a
typed error reply: KvpoolError; a connection gone or answering nonsense: ConnectionLost). The clients only
carry calls: every message is built here, every reply checked here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar, Unpack

import numpy as np

from kvpool.wire.errors import never_carried_out
from kvpool.wire.protocol import (
    PROTOCOL_VERSION,
    AdmitPrefix,
    Append,
    AppendReply,
    Cancel,
    Done,
    ErrorCode,
    ErrorReply,
    Export,
    Exported,
    Fork,
    Hello,
    HelloReply,
    Import,
    MissReason,
    OutputRows,
    Park,
    PrefixHeld,
    PrefixLookup,
    Release,
    Reply,
    RequestMessage,
    Restore,
    Shutdown,
    Stats,
    StatsReply,
    Truncate,
)
from kvpool.wire.sampling import Sampling

Result = TypeVar("Result")


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


class RequestNotSent(ConnectionLost):
    """The connection was gone (or could not be opened) before the request left: the daemon took nothing
    of it, so it may be sent again. `drained`: the daemon said farewell after a drain (kvpool.daemon.drain),
    so a successor may take over the socket."""

    def __init__(self, message: str, *, drained: bool = False) -> None:
        super().__init__(message)
        self.drained = drained


def is_farewell(reply: Reply) -> bool:
    """The frame a daemon sends every connection as it stops after a drain: `draining`, as request 0."""
    return isinstance(reply, ErrorReply) and reply.request_id == 0 and reply.code == ErrorCode.DRAINING


def to_send_again(reply: Reply) -> bool:
    """A reply saying the daemon took nothing of its request (kvpool.wire.errors.never_carried_out)."""
    return isinstance(reply, ErrorReply) and never_carried_out(reply.code)


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
    block_digests: list[bytes]  # the digests of the blocks whose end this append reaches (kvpool.wire.prefix)
    prefix_scope: str


def append_request(
    session_id: str, epoch: int, start_pos: int, *, tokens: list[int] | np.ndarray | None = None, hidden: np.ndarray | None = None,
    output_rows: str = "last", n_ctx: int = 0, admit_timeout_s: float = 0.0, sample: Sampling | None = None, direct: bool = False,
    block_digests: list[bytes] | None = None, prefix_scope: str = "",
) -> Append:
    return Append(
        session_id=session_id, epoch=epoch, start_pos=start_pos,
        tokens=None if tokens is None else [int(token) for token in tokens],
        hidden=None if hidden is None else np.ascontiguousarray(hidden, dtype="<f4").tobytes(),
        output_rows=OutputRows(output_rows), n_ctx=n_ctx, admit_timeout_s=admit_timeout_s, sample=sample, direct=direct,
        block_digests=list(block_digests or ()), prefix_scope=prefix_scope,
    )


def checked_reply(request: RequestMessage, reply: Reply, expected: type) -> Reply:
    """The reply if it is of the expected type; an ErrorReply raises KvpoolError, anything else ConnectionLost."""
    if isinstance(reply, ErrorReply):
        raise KvpoolError(reply)
    if not isinstance(reply, expected):
        raise ConnectionLost(f"the daemon answered {type(request).__name__} with {type(reply).__name__}")
    return reply


def _the_reply(reply: Any) -> Any:
    return reply


@dataclass(frozen=True, slots=True)
class Call(Generic[Result]):
    """One request, the type of the reply that answers it, and what the caller gets of that reply."""

    request: RequestMessage
    expects: type
    result: Callable[[Any], Result] = _the_reply

    def checked(self, reply: Reply) -> Any:
        """The reply if it is the one expected (checked_reply)."""
        return checked_reply(self.request, reply, self.expects)

    def outcome(self, reply: Reply) -> Result:
        """What the caller gets of the reply, once checked."""
        return self.result(self.checked(reply))


def hello_call(name: str) -> Call[HelloReply]:
    return Call(Hello(version=PROTOCOL_VERSION, client=name), HelloReply)


def append_call(session_id: str, epoch: int, start_pos: int, *, direct: bool = False, **options: Unpack[AppendOptions]) -> Call[AppendResult]:
    return Call(append_request(session_id, epoch, start_pos, direct=direct, **options), AppendReply, AppendResult.of)


def truncate_call(session_id: str, epoch: int, length: int) -> Call[int]:
    """Its result: the session's length after the truncate."""
    return Call(Truncate(session_id=session_id, epoch=epoch, length=length), Done, lambda done: done.length)


def release_call(session_id: str, epoch: int) -> Call[Done]:
    return Call(Release(session_id=session_id, epoch=epoch), Done)


def park_call(session_id: str, epoch: int, wait: bool = True) -> Call[Done]:
    return Call(Park(session_id=session_id, epoch=epoch, wait=wait), Done)


def restore_call(session_id: str, epoch: int, *, direct: bool = False, admit_timeout_s: float = 0.0) -> Call[Done]:
    return Call(Restore(session_id=session_id, epoch=epoch, direct=direct, admit_timeout_s=admit_timeout_s), Done)


def fork_call(session_id: str, epoch: int, new_session_id: str, new_epoch: int, length: int) -> Call[Done]:
    return Call(Fork(session_id=session_id, epoch=epoch, new_session_id=new_session_id, new_epoch=new_epoch, length=length), Done)


def prefix_lookup_call(scope: str, digests: list[bytes]) -> Call[int]:
    """Its result: how many leading blocks of `digests` the daemon's prefix store holds for `scope`."""
    return Call(PrefixLookup(scope=scope, digests=list(digests)), PrefixHeld, lambda held: held.blocks)


def admit_prefix_call(session_id: str, epoch: int, scope: str, digests: list[bytes], n_ctx: int = 0) -> Call[int]:
    """Its result: the admitted session's length (len(digests) blocks)."""
    return Call(AdmitPrefix(session_id=session_id, epoch=epoch, scope=scope, digests=list(digests), n_ctx=n_ctx), Done, lambda done: done.length)


def cancel_call(session_id: str, epoch: int, direct_request_id: int = 0) -> Call[Done]:
    """`direct_request_id`: the session's append in flight on its direct channel (0: none)."""
    return Call(Cancel(session_id=session_id, epoch=epoch, direct_request_id=direct_request_id), Done)


def stats_call() -> Call[StatsReply]:
    return Call(Stats(), StatsReply)


def shutdown_call(drain: bool = False) -> Call[Done]:
    return Call(Shutdown(drain=drain), Done)


IMPORT_CHUNK_BYTES = 1024**2  # an Import's state bytes at most (less where the daemon's request limit is small)
IMPORT_FRAME_ROOM = 1024  # an Import frame's bytes besides its state (ids, offsets, msgpack framing): at most this


def import_chunk_bytes(max_request_bytes: int) -> int:
    """The state bytes one Import carries to a daemon whose request limit is `max_request_bytes` (>= 1024)."""
    return min(IMPORT_CHUNK_BYTES, max(max_request_bytes - IMPORT_FRAME_ROOM, max_request_bytes // 2))


class StateExport:
    """The calls of one export, in turn (`next_call`, then `take` its reply), and the state they gather.
    Every chunk must continue the one before, of the same export and total: else ConnectionLost."""

    def __init__(self, session_id: str, epoch: int) -> None:
        self.session_id = session_id
        self.epoch = epoch
        self._parts: list[bytes] = []
        self._received = 0
        self._total: int | None = None
        self._export_id = 0

    def next_call(self) -> Call[Exported] | None:
        if self._total is not None and self._received == self._total:
            return None
        return Call(Export(session_id=self.session_id, epoch=self.epoch, offset=self._received, export_id=self._export_id), Exported)

    def take(self, chunk: Exported) -> None:
        if chunk.offset != self._received or (self._total is not None and (chunk.total_bytes, chunk.export_id) != (self._total, self._export_id)):
            raise ConnectionLost(f"the daemon answered export offset {self._received} with a chunk of another place or export")
        if not chunk.state or chunk.offset + len(chunk.state) > chunk.total_bytes:
            raise ConnectionLost(f"the daemon answered export offset {chunk.offset} with {len(chunk.state)} bytes of {chunk.total_bytes}")
        self._total, self._export_id = chunk.total_bytes, chunk.export_id
        self._parts.append(chunk.state)
        self._received += len(chunk.state)

    def state(self) -> bytes:
        return b"".join(self._parts)


def import_calls(session_id: str, epoch: int, state: bytes, chunk_bytes: int) -> Iterator[Call[int]]:
    """The Import calls that carry `state` in order; the last one's result is the imported session's length."""
    if not state:
        raise ValueError("an empty state cannot be imported")
    for offset in range(0, len(state), chunk_bytes):
        yield Call(
            Import(session_id=session_id, epoch=epoch, state=state[offset : offset + chunk_bytes], offset=offset, total_bytes=len(state)),
            Done, lambda done: done.length,
        )

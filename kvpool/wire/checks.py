"""What makes a request valid: decided here once, for the supervisor and for a worker's direct channel."""

from __future__ import annotations

import numpy as np

from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import Append, ErrorCode
from kvpool.wire.shape import ShardShape

MAX_SESSION_ID_BYTES = 256


def check_session_fields(session_id: str, epoch: int, length: int) -> None:
    """bad_request (with the session's `length`) for an id that is empty or too long, or an epoch out of range."""
    if not session_id or len(session_id.encode()) > MAX_SESSION_ID_BYTES:
        raise RequestFailed(ErrorCode.BAD_REQUEST, f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes", length=length)
    if epoch < 0 or epoch >= 2**63:
        raise RequestFailed(ErrorCode.BAD_REQUEST, "epoch must be in [0, 2^63)", length=length)


def append_rows(request: Append, shape: ShardShape, *, max_rows: int, length: int) -> np.ndarray:
    """The request's rows as a worker takes them: int32 token ids (first shard) or float32
    [rows, n_embd] hidden states; RequestFailed (bad_request, with `length`) for anything malformed."""

    def bad(message: str) -> RequestFailed:
        return RequestFailed(ErrorCode.BAD_REQUEST, message, length=length)

    if request.start_pos < 0:
        raise bad("start_pos must be >= 0")
    if shape.is_first:
        if request.tokens is None or request.hidden is not None:
            raise bad("the first shard takes token ids (tokens), not hidden states")
        rows = np.asarray(request.tokens, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= shape.n_vocab):
            raise bad(f"token ids must be in [0, {shape.n_vocab})")
        rows = rows.astype(np.int32)
    else:
        if request.hidden is None or request.tokens is not None:
            raise bad("this shard takes hidden states (hidden), not token ids")
        row_bytes = shape.n_embd * 4
        if len(request.hidden) % row_bytes:
            raise bad(f"hidden must be float32 rows of {shape.n_embd} values ({len(request.hidden)} bytes given)")
        rows = np.frombuffer(request.hidden, dtype="<f4").reshape(-1, shape.n_embd)
    if rows.shape[0] == 0:
        raise bad("an append needs at least one row")
    if rows.shape[0] > max_rows:
        raise bad(f"{rows.shape[0]} rows exceed the daemon's largest context {max_rows}")
    if request.sample is not None:
        if not shape.is_last:
            raise bad("only the last shard samples (sample is set on a shard without the output head)")
        if request.output_rows != "last":
            raise bad("sample picks from the last row: output_rows must be 'last'")
        problems = request.sample.problems(shape.n_vocab)
        if problems:
            raise bad("; ".join(problems))
    return rows


def check_position(start_pos: int, length: int, n_rows: int, n_ctx: int) -> None:
    """position_mismatch unless start_pos is the session's length; context_full past its n_ctx."""
    if start_pos != length:
        raise RequestFailed(ErrorCode.POSITION_MISMATCH, f"start_pos {start_pos} != session length {length}", length=length)
    if length + n_rows > n_ctx:
        raise RequestFailed(ErrorCode.CONTEXT_FULL, f"{length} + {n_rows} rows exceed the session's n_ctx {n_ctx}", length=length)

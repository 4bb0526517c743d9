"""What makes a request valid: decided here once, for the supervisor, a worker's direct channel and the worker's
runtime (workers.runtime maps a RequestFailed raised here to its own typed error, code, message and length kept).

Every refusal carries `length`, the length of the session (or sequence) it is about, which it leaves untouched."""

from __future__ import annotations

import math

import numpy as np

from kvpool.wire.errors import RequestFailed
from kvpool.wire.prefix import DIGEST_BYTES, MAX_SCOPE_BYTES
from kvpool.wire.protocol import Append, ErrorCode
from kvpool.wire.shape import ShardShape

MAX_SESSION_ID_BYTES = 256
TOKEN_BYTES = 4  # an int32 token id
FLOAT_BYTES = 4  # a float32 of a hidden state
SHORT_TOKEN_LIST = 64  # token ids up to this many in a list are checked without numpy (token_ids)


def _bad(message: str, length: int) -> RequestFailed:
    return RequestFailed(ErrorCode.BAD_REQUEST, message, length=length)


def check_session_fields(session_id: str, epoch: int, length: int) -> None:
    """bad_request (with the session's `length`) for an id that is empty or too long, or an epoch out of range."""
    if not session_id or len(session_id.encode()) > MAX_SESSION_ID_BYTES:
        raise _bad(f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes", length)
    if epoch < 0 or epoch >= 2**63:
        raise _bad("epoch must be in [0, 2^63)", length)


def check_admit_timeout(admit_timeout_s: float, length: int) -> None:
    """bad_request (with the session's `length`) for a wait for room that is negative or not a number (0: none;
    the daemon caps it at kvpool.daemon.admission.admission.MAX_ADMIT_WAIT_S)."""
    if not admit_timeout_s >= 0 or math.isinf(admit_timeout_s):
        raise _bad("admit_timeout_s must be a finite number of seconds >= 0", length)


def check_prefix_names(scope: str, digests: list[bytes], max_digests: int, *, length: int = 0) -> None:
    """bad_request for a scope longer than MAX_SCOPE_BYTES, more than `max_digests` block digests (the blocks
    the daemon's largest context holds) or a digest that is not DIGEST_BYTES long (kvpool.wire.prefix)."""
    if len(scope.encode()) > MAX_SCOPE_BYTES:
        raise _bad(f"a prefix scope is at most {MAX_SCOPE_BYTES} bytes", length)
    if len(digests) > max_digests:
        raise _bad(f"{len(digests)} block digests: at most {max_digests} (the blocks of this daemon's largest context)", length)
    if any(len(digest) != DIGEST_BYTES for digest in digests):
        raise _bad(f"a block digest is {DIGEST_BYTES} bytes", length)


def check_input_kind(shape: ShardShape, tokens: object, hidden: object, *, length: int) -> None:
    """Exactly one of `tokens` and `hidden` is given, the one the shard takes: token ids on the first shard,
    hidden states on every other."""
    if shape.is_first:
        if tokens is None or hidden is not None:
            raise _bad("the first shard takes token ids (tokens), not hidden states", length)
    elif hidden is None or tokens is not None:
        raise _bad("this shard takes hidden states (hidden), not token ids", length)


def token_ids(tokens: object, n_vocab: int, *, length: int) -> np.ndarray:
    """`tokens` as int32 ids: a 1-D sequence of integers in [0, n_vocab). A short list of ints (a decode step's
    id, as a request decodes) is checked in Python, without numpy's reductions; anything else as an array."""
    if type(tokens) is list and len(tokens) <= SHORT_TOKEN_LIST and all(type(token) is int for token in tokens):
        if tokens and (min(tokens) < 0 or max(tokens) >= n_vocab):
            raise _out_of_vocabulary(n_vocab, length)
        return np.array(tokens, dtype=np.int32)
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise _bad("token ids must be a 1-D sequence of integers", length)
    if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
        raise _out_of_vocabulary(n_vocab, length)
    return ids.astype(np.int32, copy=False)


def _out_of_vocabulary(n_vocab: int, length: int) -> RequestFailed:
    return _bad(f"token ids must be in [0, {n_vocab})", length)


def hidden_states(hidden: object, n_embd: int, *, length: int) -> np.ndarray:
    """`hidden` as C-contiguous float32 [n_rows, n_embd]."""
    rows = np.asarray(hidden)
    if rows.dtype != np.float32 or rows.ndim != 2 or rows.shape[1] != n_embd:
        raise _bad(f"hidden states must be float32 [n_rows, {n_embd}], got {rows.dtype} {rows.shape}", length)
    return np.ascontiguousarray(rows)


def check_row_count(n_rows: int, *, length: int) -> None:
    if n_rows < 1:
        raise _bad("an append needs at least one row", length)


def shard_rows(shape: ShardShape, rows: object, *, length: int) -> np.ndarray:
    """`rows` as the shard takes them: int32 token ids (first shard) or float32 [n_rows, n_embd] hidden
    states (every other), at least one."""
    checked = token_ids(rows, shape.n_vocab, length=length) if shape.is_first else hidden_states(rows, shape.n_embd, length=length)
    check_row_count(checked.shape[0], length=length)
    return checked


def input_rows(region: memoryview, shape: ShardShape, n_rows: int, offset: int, *, length: int) -> np.ndarray:
    """The `n_rows` rows of the shard's kind at byte `offset` of a worker's input region (a view, no copy),
    at least one and every one inside the region."""
    row_bytes = TOKEN_BYTES if shape.is_first else shape.n_embd * FLOAT_BYTES
    if n_rows < 0 or offset < 0 or offset + n_rows * row_bytes > len(region):
        raise _bad(f"{n_rows} rows at byte {offset} lie outside the input region of {len(region)} bytes", length)
    check_row_count(n_rows, length=length)
    if shape.is_first:
        return np.frombuffer(region, np.int32, n_rows, offset)
    return np.frombuffer(region, np.float32, n_rows * shape.n_embd, offset).reshape(n_rows, shape.n_embd)


def check_output_rows(output_rows: object, *, length: int) -> None:
    if output_rows not in ("last", "all"):
        raise _bad(f"output_rows must be 'last' or 'all', not {output_rows!r}", length)


def append_rows(request: Append, shape: ShardShape, *, max_rows: int, length: int) -> np.ndarray:
    """The request's rows as a worker takes them: int32 token ids (first shard) or float32
    [rows, n_embd] hidden states; RequestFailed (bad_request, with `length`) for anything malformed."""
    if request.start_pos < 0:
        raise _bad("start_pos must be >= 0", length)
    check_admit_timeout(request.admit_timeout_s, length)
    check_input_kind(shape, request.tokens, request.hidden, length=length)
    if shape.is_first:
        rows = shard_rows(shape, request.tokens, length=length)
    else:
        row_bytes = shape.n_embd * FLOAT_BYTES
        if len(request.hidden) % row_bytes:
            raise _bad(f"hidden must be float32 rows of {shape.n_embd} values ({len(request.hidden)} bytes given)", length)
        rows = shard_rows(shape, np.frombuffer(request.hidden, dtype="<f4").reshape(-1, shape.n_embd), length=length)
    if rows.shape[0] > max_rows:
        raise _bad(f"{rows.shape[0]} rows exceed the daemon's largest context {max_rows}", length)
    if request.sample is not None:
        if not shape.is_last:
            raise _bad("only the last shard samples (sample is set on a shard without the output head)", length)
        if request.output_rows != "last":
            raise _bad("sample picks from the last row: output_rows must be 'last'", length)
        problems = request.sample.problems(shape.n_vocab)
        if problems:
            raise _bad("; ".join(problems), length)
    return rows


def check_position(start_pos: int, length: int, n_rows: int, n_ctx: int) -> None:
    """position_mismatch unless start_pos is the session's length; context_full past its n_ctx."""
    if start_pos != length:
        raise RequestFailed(ErrorCode.POSITION_MISMATCH, f"start_pos {start_pos} != session length {length}", length=length)
    if length + n_rows > n_ctx:
        raise RequestFailed(ErrorCode.CONTEXT_FULL, f"{length} + {n_rows} rows exceed the session's n_ctx {n_ctx}", length=length)

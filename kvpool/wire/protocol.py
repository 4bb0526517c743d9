"""The wire protocol between routers and a shard daemon: every frame type and the codecs.

A frame (kvpool.wire.framing) carries one MessagePack-encoded tagged struct. A connection
starts with Hello (the protocol version is checked there), then carries requests, each answered by
exactly one reply frame as it completes: requests in flight at the same time on one connection may be
answered in any order. Every request carries a `request_id` chosen by the client and every reply echoes
the id of the request it answers (0 for a frame that could not be decoded), so a client matches each
reply to its request. New fields always get defaults so older peers keep
decoding.
"""

from __future__ import annotations

import enum

import msgspec

from kvpool.state.header import StateIdentity
from kvpool.wire.framing import FRAME_HEADER, frame_in_place, framed
from kvpool.wire.sampling import Sampling
from kvpool.wire.shape import ShardShape

PROTOCOL_VERSION = 3  # 2: request_id on every request and reply; 3: ShardDescription.shape, Park, Fork, tiers, sampling, Export, Import
# (later additions are fields with defaults and requests an older daemon answers bad_request: PrefixLookup, AdmitPrefix, Restore)
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
MAX_REPLY_BYTES = 2 * 1024 * 1024 * 1024 - 1  # a client's frame limit: larger than any valid reply


class Message(msgspec.Struct, tag=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Base of every frame; the tag is the class name."""


class RequestMessage(Message, kw_only=True):
    """Base of every request: `request_id` is the client's, echoed in the reply."""

    request_id: int = 0


class ReplyMessage(Message, kw_only=True):
    """Base of every reply: `request_id` of the request it answers."""

    request_id: int = 0


class ErrorCode(enum.StrEnum):
    STALE_EPOCH = "stale_epoch"
    CACHE_MISS = "cache_miss"
    POSITION_MISMATCH = "position_mismatch"
    OVER_BUDGET = "over_budget"
    CONTEXT_FULL = "context_full"
    CANCELLED = "cancelled"
    WORKER_LOST = "worker_lost"
    BAD_REQUEST = "bad_request"
    CHANNEL_REVOKED = "channel_revoked"  # a worker's direct channel only: ask the daemon (the client does)
    SHUTTING_DOWN = "shutting_down"
    DRAINING = "draining"  # the daemon is stopping and took nothing of the request: send it again to its successor
    INTERNAL = "internal"


class MissReason(enum.StrEnum):
    UNKNOWN = "unknown"
    EVICTED = "evicted"
    EXPIRED = "expired"
    WORKER_LOST = "worker_lost"
    NEW_EPOCH = "new_epoch"
    RELEASED = "released"
    RESTORE_FAILED = "restore_failed"
    IDENTITY_MISMATCH = "identity_mismatch"  # the saved state is another shard's, build's or KV layout's: refused before llama.cpp
    PREFIX_EVICTED = "prefix_evicted"  # AdmitPrefix: the prefix store no longer holds that prefix (the caller computes it)


class OutputRows(enum.StrEnum):
    LAST = "last"
    ALL = "all"


# ---- requests -------------------------------------------------------------------------------------


class Hello(RequestMessage):
    version: int
    client: str = ""


class Append(RequestMessage):
    """Prefill (many rows) or decode (one row) at start_pos, which must equal the session's length.

    Exactly one of `tokens` (first shard) or `hidden` (float32 little-endian, n_rows x n_embd) is set.
    `n_ctx` 0 means the daemon's default; it matters only when this append admits a new session.
    """

    session_id: str
    epoch: int
    start_pos: int
    tokens: list[int] | None = None
    hidden: bytes | None = None
    output_rows: OutputRows = OutputRows.LAST
    n_ctx: int = 0
    admit_timeout_s: float = 0.0
    sample: Sampling | None = None  # last shard only: pick the next token here instead of returning logits
    direct: bool = False  # bind the session to its worker's direct channel (the reply names it)
    # shared prefixes (kvpool.wire.prefix): the digests of the blocks whose end this append reaches, block
    # start_pos // block first; the daemon keeps them with the session's state to offer it to its prefix store
    block_digests: list[bytes] = []
    prefix_scope: str = ""  # the scope those digests were chained in; taken when this append admits the session


class Truncate(RequestMessage):
    """Keep positions [0, length)."""

    session_id: str
    epoch: int
    length: int


class Release(RequestMessage):
    session_id: str
    epoch: int


class Cancel(RequestMessage):
    """Abort the session's in-flight append; the session rolls back to its length before that append."""

    session_id: str
    epoch: int
    direct_request_id: int = 0  # the request id of the append in flight on the session's direct channel, if any


class Park(RequestMessage):
    """Save an idle hot session's state to the spill store now and free its context (it is restored,
    exactly, by its next append). With `wait` (the default) the reply comes once the state is in the store
    (detail "parked"); without, once the save has begun (detail "parking"): the save finishes behind the
    reply holding the session, so every later request on it (an append that restores it, a release, a Park
    that waits) waits for the save, and a save that fails ends the session (its next request: cache_miss)."""

    session_id: str
    epoch: int
    wait: bool = True


class Restore(RequestMessage):
    """Make a parked session hot again now, before its next append, so that append computes at once (a route
    restores on all its daemons at once: kvpool.router.route.Route.restore); answered Done "restored", or "hot"
    for a session that was not parked (it stays hot). Room is made as for an append that restores (waiting up to
    `admit_timeout_s`); a state that cannot be restored ends the session (cache_miss, as that append's would).
    Like every request that enters a session it revokes the session's direct channel; with `direct` the session
    is bound to its worker's direct channel again and Done.channel names it."""

    session_id: str
    epoch: int
    direct: bool = False
    admit_timeout_s: float = 0.0


class Fork(RequestMessage):
    """A new session (new_session_id, new_epoch) holding the source's first `length` positions, parked;
    independent of the source afterwards."""

    session_id: str
    epoch: int
    new_session_id: str
    new_epoch: int
    length: int


class Export(RequestMessage):
    """One chunk of the session's sealed state (kvpool.state.header: header + llama.cpp bytes, this daemon's
    identity), from `offset`. Offset 0 saves the state (a hot session stays hot) and names the export
    (`Exported.export_id`); every later chunk of that export names it too, so all chunks are of one state."""

    session_id: str
    epoch: int
    offset: int = 0
    export_id: int = 0  # 0 at offset 0; the id offset 0 answered for every later chunk


class Import(RequestMessage):
    """One chunk of a sealed state (an Export's, maybe another daemon's of the same shard identity), in order
    from offset 0, all chunks naming the same `total_bytes`. The last chunk admits the session as parked at
    this epoch, at the header's length; its next append at start_pos == length restores it."""

    session_id: str
    epoch: int
    state: bytes
    offset: int
    total_bytes: int


class PrefixLookup(RequestMessage):
    """How many leading blocks of `digests` (block 0 first, kvpool.wire.prefix) this daemon's prefix store
    holds for `scope`: answered PrefixHeld. Learns nothing of another scope's entries."""

    digests: list[bytes]
    scope: str = ""


class AdmitPrefix(RequestMessage):
    """Admit the new (session_id, epoch) holding the stored prefix named by `digests` (its len(digests)
    blocks), parked: its next append at start_pos == len(digests) * block restores it, exactly as a parked
    session's. A prefix the store no longer holds is cache_miss prefix_evicted, and nothing is admitted."""

    session_id: str
    epoch: int
    digests: list[bytes]
    scope: str = ""
    n_ctx: int = 0


class Stats(RequestMessage):
    pass


class Shutdown(RequestMessage):
    """Stop the daemon: at once, or with `drain` as on SIGTERM (kvpool.daemon.drain: nothing new is taken,
    appends in flight finish, hot sessions are parked to the spill store, then it exits)."""

    drain: bool = False


Request = Hello | Append | Truncate | Release | Cancel | Park | Restore | Fork | Export | Import | PrefixLookup | AdmitPrefix | Stats | Shutdown


# ---- replies --------------------------------------------------------------------------------------


class ShardDescription(Message):
    shape: ShardShape
    model_path: str
    source_sha256: str = ""


class HelloReply(ReplyMessage):
    version: int
    shard: ShardDescription
    max_n_ctx: int
    default_n_ctx: int
    max_request_bytes: int
    # what this daemon's saved states are sealed with and what an Import must carry (kvpool.state.header):
    # a router re-slicing states for this daemon seals them with it (kvpool.router.move)
    state_identity: StateIdentity | None = None
    prefix_block: int = 0  # tokens per block of the prefix store's digests (0: no prefix store)
    max_prefix_digests: int = 0  # the most digests a PrefixLookup or AdmitPrefix may carry


class AppendReply(ReplyMessage):
    """`data` holds float32 little-endian rows x width: hidden states (non-final shard) or logits."""

    session_id: str
    epoch: int
    length: int
    rows: int
    width: int
    data: bytes
    admitted: bool = False
    restored: bool = False  # the session was parked and its saved state restored for this append
    token: int = -1  # with Append.sample: the token picked (data then holds logits only if asked)
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)
    channel: str = ""  # with Append.direct: the worker's direct channel (an abstract Unix socket name)


class Done(ReplyMessage):
    """Reply to truncate, release, cancel, park, restore, fork, admit-prefix, import and shutdown."""

    length: int
    session_id: str = ""
    epoch: int = 0
    detail: str = ""
    channel: str = ""  # Restore with `direct`: the worker's direct channel (as AppendReply.channel)


class PrefixHeld(ReplyMessage):
    """Reply to PrefixLookup: the leading blocks of its digests the store holds (0: none), of `block` tokens."""

    blocks: int
    block: int


class Exported(ReplyMessage):
    """A chunk of an export: bytes [offset, offset + len(state)) of a sealed state of total_bytes, holding
    `length` positions of the session."""

    session_id: str
    epoch: int
    state: bytes
    offset: int
    total_bytes: int
    length: int
    export_id: int


class ErrorReply(ReplyMessage):
    code: ErrorCode
    message: str
    length: int = 0
    reason: MissReason | None = None
    session_id: str = ""
    epoch: int = 0
    retry_after_s: float | None = None  # over_budget, draining: the daemon's estimate of when to ask again (None: none)
    epoch_floor: int = 0  # stale_epoch for an id the daemon does not know: its epoch floor (README, "The contract")


class SessionRow(Message):
    session_id: str
    epoch: int
    length: int
    n_ctx: int
    charged_bytes: int
    idle_s: float
    worker_pid: int  # 0 while parked
    in_flight: bool
    tier: str = "hot"  # hot (a worker's context), ram or disk (parked in the spill store)


class WorkerRow(Message):
    name: str
    pid: int
    state: str
    uss_bytes: int
    baseline_uss_bytes: int
    session_id: str = ""
    spare_bytes: int = 0  # the charge of the spare context this free worker keeps (kvpool.daemon.books.books)
    huge_page_bytes: int = 0  # its anonymous memory in transparent huge pages when it became ready (--huge-pages)


class BudgetRow(Message):
    limit_bytes: int
    reserved_bytes: int
    measured_uss_bytes: int
    measured_vram_bytes: int | None = None
    shared_memory_bytes: int = 0  # the workers' segments: fixed, outside the session budget
    spill_limit_bytes: int = 0  # the spill store's memory tier (0: the warm tier is off)
    spill_bytes: int = 0
    spill_disk_limit_bytes: int = 0
    spill_disk_bytes: int = 0
    spare_bytes: int = 0  # kept by free workers' spare contexts (parked or released sessions' contexts): in the budget, not in reserved_bytes


class CalibrationRow(Message):
    """What a full context of n_ctx takes by the start-up probe (kvpool.daemon.admission.calibration), and
    what a session of n_ctx is charged."""

    n_ctx: int
    measured_bytes: int  # read by the probe at n_ctx cells, or extrapolated beyond the cells it filled
    charged_bytes: int
    theoretical_kv_bytes: int = 0  # f16 K and V of every layer llama.cpp allocates a cache for
    extrapolated: bool = False  # measured_bytes extrapolated at the probe's last growth per cell


class PrefixStoreRow(Message):
    """The prefix store (kvpool.daemon.books.prefixes): what it holds and what it saved."""

    block: int  # tokens per block
    limit_bytes: int
    bytes: int
    entries: int
    blocks: int  # blocks held, summed over entries (an entry serves every shorter length of its chain too)
    hits: int  # sessions admitted from a stored prefix
    hit_tokens: int  # positions those sessions did not compute
    evictions: int  # entries pushed out for room


class StatsReply(ReplyMessage):
    shard: ShardDescription
    sessions: list[SessionRow]
    workers: list[WorkerRow]
    budget: BudgetRow
    counters: dict[str, int]
    uptime_s: float
    integrity: str = "ok"  # the books' check_integrity(): "ok" or what does not balance
    calibration: list[CalibrationRow] = []  # the measurements every session's charge is fitted from
    mode: str = "process"  # how workers hold sessions: "process" (one each) or "batched" (sequences of one context)
    mode_detail: str = ""  # why this mode, and its shape (sessions per worker process)
    huge_pages: str = ""  # --huge-pages and what the first worker's load asked for (workers.runtime.huge_pages.Collapse.describe)
    threads_detail: str = ""  # a worker's llama threads and how its idle ones spin (--idle-spin; workers.server.spin): prose for `kvpool status`
    keep_warm: str = ""  # --keep-warm and what each spinner does now (kvpool.daemon.keep_warm.KeepWarm.describe): prose for `kvpool status`
    prefixes: PrefixStoreRow | None = None  # None: no prefix store


Reply = HelloReply | AppendReply | Done | PrefixHeld | Exported | ErrorReply | StatsReply

_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Message) -> bytes:
    """One whole frame: header plus payload."""
    return framed(_request_encoder.encode(message))


def encode_into(message: Message, buffer: bytearray) -> bytearray:
    """`encode`, written into `buffer`, which becomes the whole frame (resized to it): a peer that sends a frame
    every step reuses one buffer instead of allocating new ones (above the allocator's mmap threshold each is mapped
    and faulted in afresh). Never pass a buffer whose bytes are still needed: msgspec writes into it even where a
    view of it is held (where it must grow it then, it raises BufferError, after writing over the start)."""
    _request_encoder.encode_into(message, buffer, FRAME_HEADER.size)
    return frame_in_place(buffer)


def decode_request(payload: bytes) -> Request:
    return _request_decoder.decode(payload)


def decode_reply(payload: bytes | bytearray | memoryview) -> Reply:
    return _reply_decoder.decode(payload)

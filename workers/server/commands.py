"""Messages between the supervisor and one worker process, over a pipe (bulk rows go through shared memory, a saved state beside its message in a memfd: workers.server.pipe).

Where the rows lie in the worker's segment: workers.server.segment. A worker serves one command at a time and answers each with exactly one reply.
"""

from __future__ import annotations

import msgspec

from kvpool.wire.sampling import Sampling
from kvpool.wire.shape import ShardShape

OPEN_FAILED = "open_failed"  # Failed.code: the context asked for could not be created
RESTORE_FAILED = "restore_failed"  # Failed.code: the saved state could not be restored (its context freed)


class Command(msgspec.Struct, tag=True, forbid_unknown_fields=True, kw_only=True):
    pass


class OpenContext(Command):
    n_ctx: int
    seq: int = 0  # a batched worker: the sequence (emptied, then limited to n_ctx positions)


class Binding(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The session a direct channel serves."""

    session_id: str
    epoch: int


class RunAppend(Command):
    """Input rows are in the input region: int32 token ids on a first shard, float32 [n_rows, n_embd]
    hidden states on any other (the worker knows which shard it runs). One round trip for an append through
    the supervisor: like every command it revokes the direct channel first; with n_ctx > 0 a fresh context
    of n_ctx positions is opened before the rows run (an admission's open; Failed open_failed if it cannot
    be); with `bind` the direct channel serves that session once the append has succeeded. With `restore` (a
    parked session's restore, its blob beside this command as a RestoreState's travels) the state is restored
    first, as that command would (its failure is this command's Failed, nothing appended; Appended.restored
    says how it went): a restoring append is one round trip too."""

    start_pos: int
    n_rows: int
    output_rows: str = "last"
    sample: Sampling | None = None  # last shard: pick the next token (rows come back only with sample.logits)
    n_ctx: int = 0
    bind: Binding | None = None
    restore: RestoreState | None = None


class TruncateContext(Command):
    length: int
    seq: int = 0


class BatchItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One sequence's append in a RunBatch: its rows at `input_offset` of the input region; its result
    rows written at `output_offset` of the output region when they fit in `output_capacity` bytes."""

    seq: int
    start_pos: int
    n_rows: int
    input_offset: int
    output_offset: int
    output_capacity: int
    output_rows: str = "last"
    sample: Sampling | None = None


class RunBatch(Command):
    """A batched worker: the items' appends (one per sequence) decoded together; one reply, BatchDone."""

    items: list[BatchItem]


class CloseContext(Command):
    """The open context freed, and the spare with it; with `keep` (a released session's, process mode) the open
    context is kept as the worker's spare instead, as SaveState.keep leaves one without a save: its cells belong
    to no park (owner 0), so it is zeroed before any context is opened in it, or once the worker has sat idle.
    A keep with no context open is refused (no_context) and leaves the spare as it is."""

    seq: int = 0
    keep: bool = False


class SaveState(Command):
    """The open context's sequence state, as bytes in the reply (Saved; its bytes travel beside it:
    workers.server.pipe). With `keep` (a park, process mode) the context is kept as the worker's spare, the
    sequence's cells still in it: no context is open after the reply, and the next OpenContext /
    RunAppend.n_ctx / RestoreState of the same n_ctx takes the spare instead of creating one (cleared, cells
    and KV, as a fresh context is, unless it is the RestoreState of this park's `owner`, which resumes the
    cells); CloseContext or any other n_ctx frees it."""

    seq: int = 0
    keep: bool = False
    owner: int = 0  # with keep: the park's token (the supervisor's, one per park; 0: none) the spare's KV belongs to
    head: int = 0  # bytes the reply's memfd leaves before the state's (the supervisor's header: workers.server.pipe)
    tail: int = 0  # and after them (its CRC)
    behind: bool = False  # no caller waits for it (a park answered before its save, --park-after, --persist-after): a single worker saves at a lower CPU priority (workers.server.background)


class RestoreState(Command):
    """A fresh context of n_ctx positions (the spare, if it has that n_ctx) loaded with `blob` (from
    SaveState) and cut to `length`; into the unzeroed spare of the park `owner` names, the cells that park
    saved are resumed instead and the blob is not read (Restored.in_place). On failure that context is freed
    (Failed, code restore_failed)."""

    n_ctx: int
    length: int
    blob: memoryview = memoryview(b"")  # empty on the wire; received: a view of the bytes that travel beside (workers.server.pipe)
    seq: int = 0
    blob_bytes: int = 0  # on the wire: the size of the blob that travels beside the command
    blob_offset: int = 0  # on the wire: where in that memfd the blob begins
    owner: int = 0  # the restored state's park token: the spare that park left is taken without zeroing, its cells resumed
    bind: Binding | None = None  # alone (a Restore request): the direct channel serves this session once restored (RunAppend.restore: its run's bind)


class BindChannel(Command):
    """Serve (session_id, epoch)'s appends from the worker's direct channel too, until any other
    command from the supervisor (every one of them revokes the channel first). The supervisor binds with
    RunAppend.bind or RestoreState.bind; this stands alone for tools (scripts/probe_direct_path.py), a binding
    that a save revoked (a prefix capture's) and a hot session's Restore (entering the session revoked it)."""

    session_id: str
    epoch: int


class RevokeChannel(Command):
    """End the direct channel's binding; the reply carries the context's length."""


class Exit(Command):
    pass


class CancelDirect(Command):
    """On the cancel pipe: abort (session_id, epoch)'s direct append `request_id`, running or not started."""

    session_id: str
    epoch: int
    request_id: int


class WorkerReply(msgspec.Struct, tag=True, forbid_unknown_fields=True, kw_only=True):
    pass


class Ready(WorkerReply):
    pid: int
    shape: ShardShape
    kv_bytes_per_position: int
    context_bytes: int = 0  # a batched worker: what its one context of every sequence took (anonymous memory)
    huge_page_bytes: int = 0  # its anonymous memory in transparent huge pages once loaded (the repacked weights: --huge-pages)
    huge_pages: str = ""  # what its load asked of the kernel for them (workers.runtime.huge_pages.Collapse.describe)
    idle_spin: str = ""  # how long its idle llama.cpp threads spin (workers.server.spin.set_idle_spin)


class Opened(WorkerReply):
    n_ctx: int
    reused: bool = False  # the worker's spare context, not a new one


class Appended(WorkerReply):
    """The result rows, float32 [rows, width], are in the output region, or in `inline` when they are
    larger than that region (every row's logits of a long prefill on the last shard)."""

    length: int
    rows: int
    width: int
    inline: bytes = b""
    output_offset: int = 0  # a batched worker: where in the output region the rows are
    token: int = -1
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)
    restored: Restored | None = None  # the RunAppend's restore, when it carried one
    reused: bool = False  # the RunAppend's open (n_ctx) took the worker's spare context: none was created


class Truncated(WorkerReply):
    length: int


class Closed(WorkerReply):
    pass


class Saved(WorkerReply):
    length: int
    blob: bytes = b""  # empty on the wire; received: the bytes that travel beside the reply, or their SharedState (workers.server.pipe)
    blob_bytes: int = 0  # on the wire: their size
    head: int = 0  # SaveState's room in the memfd before the bytes
    tail: int = 0  # and after them


class Restored(WorkerReply):
    length: int
    reused: bool = False  # restored into the worker's spare context rather than a new one
    in_place: bool = False  # that spare still held the park's own cells: nothing was loaded (the blob unread)
    seconds: float = 0.0  # the worker's time for it (RunAppend.restore: the supervisor cannot see it apart from the append's)


class ChannelState(WorkerReply):
    length: int


class Failed(WorkerReply):
    code: str
    message: str
    length: int = 0


class BatchDone(WorkerReply):
    """RunBatch's reply: per item, in order, Appended or Failed (a failed item changed nothing)."""

    results: list[Appended | Failed]


AnyCommand = OpenContext | RunAppend | RunBatch | TruncateContext | CloseContext | SaveState | RestoreState | BindChannel | RevokeChannel | Exit
AnyWorkerReply = Ready | Opened | Appended | BatchDone | Truncated | Closed | Saved | Restored | ChannelState | Failed

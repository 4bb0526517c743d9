"""How the books wrap a session's llama.cpp state for the spill store, and unwrap it: every stored state
carries kvpool.state.header's header (this daemon's identity, the session, its length, when it was saved and
last used) under a CRC-32C. A state that does not open here (another shard, build or layout; a failed
checksum; another session's) raises CorruptBlob and never reaches a worker."""

from __future__ import annotations

import time
from collections.abc import Sequence

import llama_cpp

from kvpool.daemon.books.sessions import Session
from kvpool.daemon.books.spill import CorruptBlob
from kvpool.shard.header import ShardInfo
from kvpool.state.header import (
    CRC_BYTES,
    FORMAT_VERSION,
    IDENTITY,
    OWNER,
    StateHeader,
    StateIdentity,
    StateRejected,
    head_size,
    open_state_view,
    seal,
    seal_shared,
    sealed_size,
)
from kvpool.state.shared import SharedPayload, SharedState, payload_view

# the payload size a park's room is sized for (a header's size depends on its numbers' msgpack widths; any
# payload from 64 KiB to 4 GiB takes as many bytes as this one): a state outside it is sealed as a copy
ROOM_PAYLOAD_BYTES = 1 << 20


def wall_clock_of(monotonic_s: float) -> float:
    """time.time() of a time.monotonic() reading (the books keep monotonic times, headers wall-clock ones)."""
    return time.time() - max(time.monotonic() - monotonic_s, 0.0)


def monotonic_of(wall_s: float) -> float:
    """time.monotonic() of a wall-clock time (never later than now: a clock set back does not revive it)."""
    return time.monotonic() - max(time.time() - wall_s, 0.0)


class StateSeal:
    def __init__(self, identity: StateIdentity) -> None:
        self.identity = identity

    def _header(self, session: Session, payload_bytes: int, length: int | None = None) -> StateHeader:
        return StateHeader(
            version=FORMAT_VERSION, identity=self.identity, session_id=session.session_id, epoch=session.epoch,
            length=session.length if length is None else length, n_ctx=session.n_ctx, saved_at=time.time(), last_used=wall_clock_of(session.last_used),
            payload_bytes=payload_bytes,
        )

    def seal(self, session: Session, payload: bytes | SharedState, *, length: int | None = None) -> bytes | SharedState:
        """`length`: the positions the payload holds when it is not the session's length now (saved before an
        append). A SharedState (its payload saved with `room`) is sealed in place and returned; one whose room
        does not fit the header is copied out and freed."""
        if isinstance(payload, SharedState):
            header = self._header(session, payload.payload_bytes, length)
            try:
                if seal_shared(header, payload):
                    return payload
            except OSError:  # the memfd refused a write or its seals: the bytes are still whole, sealed as a copy
                pass
            data = bytes(payload.payload)
            payload.close()
            return seal(header, data)
        return seal(self._header(session, len(payload), length), payload)

    def room(self, session: Session) -> tuple[int, int]:
        """(head, tail): the bytes a saved state of `session` leaves around its payload for seal() to seal it
        in place (workers.server.commands.SaveState)."""
        return head_size(self._header(session, ROOM_PAYLOAD_BYTES)), CRC_BYTES

    def size(self, session: Session, payload_bytes: int) -> int:
        """The stored size of a payload of `payload_bytes` sealed for `session`."""
        return sealed_size(self._header(session, payload_bytes))

    def open(self, session: Session, data: bytes | SharedState) -> bytes:
        """The payload of `session`'s stored state; raises CorruptBlob (`mismatch` when the state is another
        daemon's: its identity differs)."""
        return bytes(payload_view(self.open_view(session, data)))

    def open_view(self, session: Session, data: bytes | SharedState) -> memoryview | SharedPayload:
        """open, the payload a read-only view of `data` (kvpool.state.header.open_state_view), or of a
        SharedState its SharedPayload (a restore sends its descriptor on)."""
        try:
            header, payload = open_state_view(data, self.identity)
            if (header.session_id, header.epoch) != session.key or header.length < session.length:
                raise StateRejected(OWNER, f"the stored state is {header.session_id!r} epoch {header.epoch} of {header.length} positions")
        except StateRejected as rejected:
            raise CorruptBlob(f"{rejected} ({rejected.reason})", mismatch=rejected.reason == IDENTITY) from None
        return SharedPayload(data) if isinstance(data, SharedState) else payload


def shard_identity(
    info: ShardInfo, *, shard_sha256: str, block_sha256: Sequence[str], flash_attn: bool, kv_bytes_per_position: int, seqs_per_context: int
) -> StateIdentity:
    """This daemon's identity: its shard file (`shard_sha256`, hashed once at start), the source it was cut
    from, the weights of the layers it computes (`block_sha256`, whose first n_layers blocks are those layers:
    both from kvpool.shard.digests.verified_digests of its file), the llama.cpp build and the cache layout of kvpool's contexts
    (workers.runtime.params keeps llama.cpp's default K/V types)."""
    defaults = llama_cpp.llama_context_default_params()
    shape = info.shape
    return StateIdentity(
        source_sha256=info.source_sha256 or "", layer_start=shape.layer_start, layer_stop=shape.layer_stop,
        lookahead_layers=info.lookahead_layers, shard_sha256=shard_sha256,
        llama_build=f"llama-cpp-python {llama_cpp.__version__}", type_k=int(defaults.type_k), type_v=int(defaults.type_v),
        flash_attn=flash_attn, kv_bytes_per_position=kv_bytes_per_position, seqs_per_context=seqs_per_context,
        layer_sha256=tuple(block_sha256[: shape.n_layers]),
    )

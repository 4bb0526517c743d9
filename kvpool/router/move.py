"""Moving one session from a route onto another (Router.replan): every old daemon's sealed state is exported,
opened and read into per-layer K/V; for each new daemon the layers of its range are assembled from them
(kvpool.state.reslice: any split of the same source), sealed with that daemon's identity (its Hello names it)
under the next epoch, and imported there. The old epoch is released on the old daemons right after the
exports, before the imports, so a daemon on both routes holds the session once.

What a move checks before a byte reaches a new daemon: every exported state is whole (its CRC-32C), of the
session at the length the router holds, and of the source, llama.cpp build and KV layout of every new daemon
(K/V types, V layout, mode); every layer a new daemon computes holds the weights of the old daemon whose
state has that layer (their identities' per-layer digests, kvpool.shard.digests: K/V computed with one
layer's weights never continues on others; a digest missing on either side fails too); the inputs cover the
new daemons' layers. Anything else is MoveFailed, and the caller replays that session instead; what a new
daemon refuses is MoveFailed too, after the daemons that took it are released again. Either way the old
epoch is released once the exports are done.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.router.route import Route
from kvpool.state.header import StateHeader, StateIdentity, StateRejected, open_state, read_header, seal
from kvpool.state.reslice import ResliceError, ShardState, reslice_bytes
from kvpool.state.sequence import StateFormatError, cut_state, parse_state

# What every state of one move must share besides the source model: the bytes of one layer mean the same on every daemon.
_SHARED_LAYOUT = ("llama_build", "type_k", "type_v", "flash_attn", "seqs_per_context")


class MoveFailed(Exception):
    """The session could not be moved; `step` names where: export, state, layout, weights, reslice or import."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step


@dataclasses.dataclass(frozen=True, slots=True)
class Moved:
    length: int  # positions every new daemon holds
    exported_bytes: int  # sealed state bytes read from the old daemons
    imported_bytes: int  # sealed state bytes written to the new daemons


def move_session(old: Route, new: Route, session_id: str, epoch: int, new_epoch: int, length: int) -> Moved:
    """Move (session_id, epoch) of `length` positions from `old` onto `new` as (session_id, new_epoch). The
    old epoch is released on `old` whatever happens (a failed move replays on `new`), once every state is out."""
    try:
        exported = [_export(stage, client, session_id, epoch) for stage, client in enumerate(old.clients)]
    finally:
        _release(old, session_id, epoch)
    headers = [header for header, _, _ in exported]
    targets = [_identity(stage, client) for stage, client in enumerate(new.clients)]
    _check_same(headers, targets, session_id, epoch, length)
    _check_weights([header.identity for header in headers], targets)
    inputs = [_shard_state(header, payload) for header, payload, _ in exported]
    sealed = [_sealed_for(target, headers[0], inputs, new_epoch) for target in targets]
    _import_all(new, session_id, new_epoch, length, sealed)
    return Moved(length, sum(size for _, _, size in exported), sum(len(blob) for blob in sealed))


def _export(stage: int, client: Client, session_id: str, epoch: int) -> tuple[StateHeader, bytes, int]:
    try:
        blob = client.export_state(session_id, epoch)
    except (KvpoolError, ConnectionLost) as error:
        raise MoveFailed("export", f"daemon {stage} of the old route: {error}") from None
    try:
        header = read_header(blob)
        header, payload = open_state(blob, header.identity)  # the checksum; its identity is checked below
    except StateRejected as rejected:
        raise MoveFailed("state", f"daemon {stage} of the old route exported a state refused ({rejected.reason}): {rejected}") from None
    return header, payload, len(blob)


def _identity(stage: int, client: Client) -> StateIdentity:
    identity = client.hello.state_identity
    if identity is None:
        raise MoveFailed("layout", f"daemon {stage} of the new route names no state identity (an older kvpool)")
    return identity


def _check_same(headers: list[StateHeader], targets: list[StateIdentity], session_id: str, epoch: int, length: int) -> None:
    for header in headers:
        if (header.session_id, header.epoch, header.length) != (session_id, epoch, length):
            raise MoveFailed(
                "state", f"an exported state is of {header.session_id!r} epoch {header.epoch} at length {header.length}, "
                f"the router holds {session_id!r} epoch {epoch} at length {length}",
            )
    first = headers[0].identity
    for identity in [header.identity for header in headers] + targets:
        differ = [name for name in _SHARED_LAYOUT if getattr(identity, name) != getattr(first, name)]
        if source_of(identity) != source_of(first):
            differ.insert(0, "source model")
        if differ:
            raise MoveFailed("layout", f"the routes' daemons differ in {', '.join(differ)}: a state cannot move between them")


def _check_weights(held: list[StateIdentity], targets: list[StateIdentity]) -> None:
    """Every layer of every new daemon has the digest the old daemon holding it names (a layer no old daemon
    holds is the re-slice's to refuse)."""
    for stage, target in enumerate(targets):
        for layer in range(target.layer_start, target.layer_stop):
            old_stage = next((index for index, identity in enumerate(held) if identity.layer_start <= layer < identity.layer_stop), None)
            if old_stage is None:
                continue
            old, new = held[old_stage].layer_digest(layer), target.layer_digest(layer)
            if old is None or new is None:
                side = f"daemon {old_stage} of the old route" if old is None else f"daemon {stage} of the new route"
                raise MoveFailed("weights", f"layer {layer}: {side} names no digest of its weights (an older kvpool)")
            if old != new:
                raise MoveFailed(
                    "weights", f"layer {layer}: daemon {stage} of the new route holds other weights (sha256 {new[:16]}...) "
                    f"than daemon {old_stage} of the old route computed its K/V with ({old[:16]}...)",
                )


def source_of(identity: StateIdentity) -> str:
    """The sha256 of the whole model a state's layers are of (a whole model's own file names it)."""
    return identity.source_sha256 or identity.shard_sha256


def _shard_state(header: StateHeader, payload: bytes) -> ShardState:
    identity = header.identity
    try:
        state = cut_state(parse_state(payload), header.length)  # a parked state truncated by its header holds more
        return ShardState(identity.layer_start, identity.layer_stop, identity.lookahead_layers, state)
    except (StateFormatError, ResliceError) as error:
        raise MoveFailed("state", f"the state of layers {identity.layer_start}:{identity.layer_stop}: {error}") from None


def _sealed_for(target: StateIdentity, template: StateHeader, inputs: list[ShardState], new_epoch: int) -> bytes:
    try:
        payload = reslice_bytes(inputs, target.layer_start, target.layer_stop, target.lookahead_layers)
    except ResliceError as error:
        raise MoveFailed("reslice", str(error)) from None
    header = msgspec.structs.replace(template, identity=target, epoch=new_epoch, saved_at=time.time(), payload_bytes=len(payload))
    return seal(header, payload)


def _release(route: Route, session_id: str, epoch: int) -> None:
    """The old epoch goes everywhere it can; a daemon that fails to release it expires it by its TTL."""
    try:
        route.release(session_id, epoch)
    except (KvpoolError, ConnectionLost):
        pass


def _import_all(new: Route, session_id: str, new_epoch: int, length: int, sealed: list[bytes]) -> None:
    taken: list[int] = []
    try:
        for stage, (client, blob) in enumerate(zip(new.clients, sealed, strict=True)):
            try:
                held = client.import_state(session_id, new_epoch, blob)
            except (KvpoolError, ConnectionLost) as error:
                raise MoveFailed("import", f"daemon {stage} of the new route: {error}") from None
            taken.append(stage)
            if held != length:
                raise MoveFailed("import", f"daemon {stage} of the new route holds {held} positions, {length} were moved")
    except MoveFailed:
        for stage in taken:
            try:
                new.clients[stage].release(session_id, new_epoch)
            except (KvpoolError, ConnectionLost):
                pass
        raise

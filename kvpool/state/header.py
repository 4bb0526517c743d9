"""The header every state kvpool saves carries before llama.cpp's bytes: what the bytes are (the shard, the
llama.cpp build and the KV layout they depend on), whose they are (session id, epoch, length) and when they
were saved and last used, with a CRC-32C of header and payload. A state is opened only by a daemon whose
identity equals the header's, and only when its checksum holds: llama.cpp never sees bytes that fail either.

Layout, little-endian:

    MAGIC (8 bytes) | u32 header length H | H bytes: StateHeader as msgpack | payload | u32 CRC-32C of all before

`StateRejected.reason` says why a state was refused: truncated, magic (not a kvpool state, or an older
format), version, header (undecodable), checksum, identity (another shard, build or layout), owner (another
session, epoch or length than expected).
"""

from __future__ import annotations

import ctypes
import pathlib
import struct

import google_crc32c
import msgspec
import numpy as np

from kvpool.state.shared import SharedState

MAGIC = b"KVPSTAT1"
FORMAT_VERSION = 1
_LENGTH = struct.Struct("<I")
_CRC = struct.Struct("<I")
CRC_BYTES = _CRC.size
MAX_HEADER_BYTES = 1 << 16
# CRC-32C of any bytes followed by their own CRC-32C (little-endian), whatever the bytes: checking a state
# against it reads the state once, with no copy of all but its last 4 bytes (tests/unit/test_state_header.py)
CRC_RESIDUE = 0x48674BC7

TRUNCATED, BAD_MAGIC, BAD_VERSION, BAD_HEADER, BAD_CHECKSUM, IDENTITY, OWNER = (
    "truncated", "magic", "version", "header", "checksum", "identity", "owner",
)


class StateRejected(ValueError):
    """A saved state that must not reach llama.cpp; `reason` is one of the module's reason names."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class StateIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a state's bytes depend on: equal identities restore each other's states, nothing else does."""

    source_sha256: str  # the whole model the shard was cut from ("" for a whole model: shard_sha256 names it)
    layer_start: int
    layer_stop: int
    lookahead_layers: int
    shard_sha256: str  # the shard file itself
    llama_build: str  # "llama-cpp-python <version>": the llama.cpp it vendors writes the bytes
    type_k: int  # ggml types of the cache
    type_v: int
    flash_attn: bool  # V is stored transposed without flash attention
    kv_bytes_per_position: int  # every layer's K and V widths, summed
    seqs_per_context: int = 1  # batched mode's sequences per context (a KV stream each): states stay within one mode
    # sha256 (hex) of the weights of each layer the shard computes, layer_start first (kvpool.shard.digests);
    # () in a header written before digests: such a state opens under no identity that names them
    layer_sha256: tuple[str, ...] = ()

    def layer_digest(self, layer: int) -> str | None:
        """The digest of source layer `layer` (one this shard computes), None when this identity names none."""
        if len(self.layer_sha256) != self.layer_stop - self.layer_start or not self.layer_start <= layer < self.layer_stop:
            return None
        return self.layer_sha256[layer - self.layer_start]


UNBOUND = StateIdentity("", 0, 0, 0, "", "", 0, 0, False, 0, 0)  # books without a shard (pure-logic tests)


class StateHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    identity: StateIdentity
    session_id: str
    epoch: int
    length: int  # positions the state holds (a restore may cut it shorter)
    n_ctx: int  # the session's context size
    saved_at: float  # wall-clock seconds (time.time())
    last_used: float  # wall-clock seconds of the session's last use
    payload_bytes: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StateHeader)


def seal(header: StateHeader, payload: bytes) -> bytes:
    """The state as stored: header and payload under one CRC-32C."""
    if header.payload_bytes != len(payload):
        raise ValueError(f"the header says {header.payload_bytes} payload bytes, the payload has {len(payload)}")
    encoded = _encoder.encode(header)
    head = b"".join((MAGIC, _LENGTH.pack(len(encoded)), encoded))
    crc = google_crc32c.extend(google_crc32c.value(head), payload)
    return b"".join((head, payload, _CRC.pack(crc)))  # the payload copied once


def _crc32c_library() -> ctypes.CDLL | None:
    """google-crc32c's own C library (its wheels ship it beside the package), for buffers its Python API
    refuses (it takes bytes only); None where it is not found (a copy to bytes then)."""
    for path in sorted((pathlib.Path(google_crc32c.__file__).parent.parent / "google_crc32c.libs").glob("libcrc32c*.so*")):
        try:
            library = ctypes.CDLL(str(path))
        except OSError:
            continue
        library.crc32c_extend.restype = ctypes.c_uint32
        library.crc32c_extend.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
        return library
    return None


_crc32c = _crc32c_library()


def crc32c_extend(crc: int, data: bytes | memoryview) -> int:
    """google_crc32c.extend for any contiguous buffer (a mapping's view among them), with no copy."""
    if isinstance(data, bytes):
        return google_crc32c.extend(crc, data)
    view = memoryview(data).cast("B")
    if _crc32c is None:
        return google_crc32c.extend(crc, bytes(view))
    return _crc32c.crc32c_extend(crc, np.frombuffer(view, np.uint8).ctypes.data if len(view) else None, len(view))


def head_size(header: StateHeader) -> int:
    """The bytes before the payload in a sealed state of `header`."""
    return len(MAGIC) + _LENGTH.size + len(_encoder.encode(header))


def seal_shared(header: StateHeader, state: SharedState) -> bool:
    """Seal `state` in place (its payload already there, `head` bytes free before it for the header and
    `tail` after it for the CRC): the header and CRC written in and the memfd sealed. False, touching
    nothing, when its room does not fit this header (the caller seals a copy then)."""
    if header.payload_bytes != state.payload_bytes:
        raise ValueError(f"the header says {header.payload_bytes} payload bytes, the state has {state.payload_bytes}")
    encoded = _encoder.encode(header)
    head = b"".join((MAGIC, _LENGTH.pack(len(encoded)), encoded))
    if len(head) != state.head or state.tail != _CRC.size:
        return False
    state.write_at(0, head)
    crc = crc32c_extend(google_crc32c.value(head), state.payload)
    state.write_at(state.head + state.payload_bytes, _CRC.pack(crc))
    state.seal()
    return True


def sealed_size(header: StateHeader) -> int:
    """The bytes seal() gives for `header` and its payload."""
    return len(MAGIC) + _LENGTH.size + len(_encoder.encode(header)) + header.payload_bytes + _CRC.size


def read_header(data: bytes | memoryview) -> StateHeader:
    """The header of a stored state, checked for framing only (the checksum is open_state's)."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LENGTH.size + _CRC.size:
        raise StateRejected(TRUNCATED, f"{len(view)} bytes are too few for a saved state")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise StateRejected(BAD_MAGIC, "not a kvpool saved state of this format")
    (size,) = _LENGTH.unpack_from(view, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if size > MAX_HEADER_BYTES or start + size + _CRC.size > len(view):
        raise StateRejected(TRUNCATED, f"a header of {size} bytes does not fit in {len(view)} bytes")
    try:
        header = _decoder.decode(view[start : start + size])
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        if _version_of(view[start : start + size]) not in (None, FORMAT_VERSION):
            raise StateRejected(BAD_VERSION, f"a saved state of format {_version_of(view[start : start + size])}, this daemon reads {FORMAT_VERSION}") from None
        raise StateRejected(BAD_HEADER, f"the header does not decode: {error}") from None
    if header.version != FORMAT_VERSION:
        raise StateRejected(BAD_VERSION, f"a saved state of format {header.version}, this daemon reads {FORMAT_VERSION}")
    if start + size + header.payload_bytes + _CRC.size != len(view):
        raise StateRejected(TRUNCATED, f"the header says {header.payload_bytes} payload bytes, {len(view) - start - size - _CRC.size} are there")
    return header


def _version_of(encoded: memoryview) -> int | None:
    try:
        version = msgspec.msgpack.decode(encoded).get("version")
    except Exception:  # noqa: BLE001 - anything undecodable has no version to report
        return None
    return version if isinstance(version, int) else None


def open_state(data: bytes, identity: StateIdentity) -> tuple[StateHeader, bytes]:
    """(header, payload) of a stored state whose checksum holds and whose identity is `identity`; raises
    StateRejected otherwise."""
    header, payload = open_state_view(data, identity)
    return header, bytes(payload)


def open_state_view(data: bytes | memoryview | SharedState, identity: StateIdentity) -> tuple[StateHeader, memoryview]:
    """open_state with the payload a read-only view of `data`, not a copy (a restore hands it on to its
    worker's memfd as it is: 3.76 MiB copied less per restore at 512 positions of the middle bundled shard).
    A sealed SharedState is not read again: seal_shared computed its CRC over these pages, which nothing
    can have changed since (kvpool.state.shared)."""
    if isinstance(data, SharedState):
        if not data.sealed:
            raise StateRejected(BAD_CHECKSUM, "a shared state that is not sealed")
        view = data.view
        header = read_header(view)
    else:
        view = memoryview(data).toreadonly()
        header = read_header(view)
        if crc32c_extend(0, view) != CRC_RESIDUE:
            raise StateRejected(BAD_CHECKSUM, "the saved state fails its CRC-32C")
    if header.identity != identity:
        raise StateRejected(IDENTITY, f"saved by another shard, build or KV layout: {_difference(header.identity, identity)}")
    end = len(view) - _CRC.size
    return header, view[end - header.payload_bytes : end]  # of the bytes the CRC was checked on


def _difference(saved: StateIdentity, ours: StateIdentity) -> str:
    fields = [name for name in StateIdentity.__struct_fields__ if getattr(saved, name) != getattr(ours, name)]
    return ", ".join(f"{name} {getattr(saved, name)!r} (this daemon: {getattr(ours, name)!r})" for name in fields[:3])

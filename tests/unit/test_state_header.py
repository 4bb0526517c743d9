"""The sealed state's checksum (kvpool.state.header): the same layout as ever, checked by the CRC-32C residue."""

from __future__ import annotations

import random
import struct

import google_crc32c
import pytest

from kvpool.state.header import CRC_RESIDUE, FORMAT_VERSION, StateHeader, StateIdentity, StateRejected, open_state, seal

IDENTITY = StateIdentity("ab" * 32, 10, 20, 0, "cd" * 32, "llama-cpp-python 0.3.36", 1, 1, False, 7680)


def _sealed(payload: bytes) -> bytes:
    header = StateHeader(version=FORMAT_VERSION, identity=IDENTITY, session_id="s", epoch=3, length=5, n_ctx=64,
                         saved_at=1.0, last_used=0.5, payload_bytes=len(payload))
    return seal(header, payload)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 63, 4096, 1 << 20])
def test_any_bytes_followed_by_their_crc32c_give_the_residue(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert google_crc32c.value(data + struct.pack("<I", google_crc32c.value(data))) == CRC_RESIDUE


def test_a_sealed_state_ends_with_the_crc32c_of_all_before_it() -> None:
    """The layout states written before the residue check keep: they open as they did."""
    payload = random.Random(7).randbytes(10_000)
    data = _sealed(payload)
    assert struct.unpack("<I", data[-4:])[0] == google_crc32c.value(data[:-4])
    assert data[-4 - len(payload) : -4] == payload
    assert open_state(data, IDENTITY)[1] == payload


def test_every_flipped_bit_of_a_small_state_is_refused() -> None:
    data = _sealed(b"\x07\x00\xff" * 20)
    for index in range(len(data)):
        for bit in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[index] ^= bit
            with pytest.raises(StateRejected):
                open_state(bytes(damaged), IDENTITY)

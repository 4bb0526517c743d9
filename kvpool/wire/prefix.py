"""What names a shared prefix on the wire: the chained digests of a prompt's token blocks (README, "Shared
prefixes").

A prefix is a whole number of blocks of `block` tokens. Block i's digest covers block i's token ids and block
i-1's digest; block 0's covers a seed made of the scope and the block size. So one digest names the scope and
every token before its block's end, and two prompts share block i's digest exactly when they share the scope
and their first (i + 1) * block tokens. The router computes them (it holds the tokens; a shard past the first
sees hidden states only) and every daemon of a route keys its prefix store by them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16
MAX_SCOPE_BYTES = 256
_SEED = b"kvpool prefix blocks v1"


def scope_seed(scope: str, block: int) -> bytes:
    """The digest block 0 chains from: the scope and the block size."""
    encoded = scope.encode()
    return hashlib.blake2b(_SEED + len(encoded).to_bytes(4, "little") + encoded + block.to_bytes(4, "little"), digest_size=DIGEST_BYTES).digest()


def block_digest(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """One block's digest: its parent's digest (or the scope seed) and its token ids as int32."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype="<i4").tobytes(), digest_size=DIGEST_BYTES).digest()


def chain_digests(tokens: Sequence[int], block: int, scope: str = "", *, start: int = 0, parents: Sequence[bytes] = ()) -> list[bytes]:
    """The digests of every whole block of `tokens` from block `start` on; `parents` are the digests of
    blocks [0, start) when they are known (the chain continues from the last of them)."""
    if block < 1:
        raise ValueError("a block holds at least one token")
    if len(parents) != start:
        raise ValueError(f"{len(parents)} parent digests given for a chain that continues at block {start}")
    ids = np.asarray(tokens, dtype=np.int64)
    parent = parents[-1] if parents else scope_seed(scope, block)
    digests = []
    for index in range(start, len(ids) // block):
        parent = block_digest(parent, ids[index * block : (index + 1) * block])
        digests.append(parent)
    return digests

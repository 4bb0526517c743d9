"""Per-layer digests of a GGUF file's weights, for a whole model and a shard alike: what a daemon's identity
names for the layers it computes, so that K/V computed with one layer's weights never continues on others.

The digest of block i is sha256 over its tensors `blk.i.*` in the order of their name suffixes (the part
after `blk.i.`), each contributing its suffix, ggml type, dims and data bytes, every field length-prefixed.
The block index itself is not hashed: a shard stores the source's blocks [A, B + lookahead) byte for byte
as blocks 0, 1, ..., so its block j has the source's digest of layer A + j by construction. `kvpool shard`
records the source's digests of the blocks a shard stores (kvpool.shard.header.KEY_LAYER_SHA256); a daemon
computes its file's at load and refuses a file whose blocks differ from what it records (WeightsMismatch).

The bytes are read through an mmap of the file at the offsets of the header's tensor infos
(kvpool.shard.header), never through gguf.GGUFReader (whose field parsing of a vocabulary takes seconds).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import struct
from concurrent.futures import ThreadPoolExecutor

from kvpool.shard.errors import ShardError
from kvpool.shard.header import BLOCK_TENSOR, GgufHeader, ShardInfo, TensorInfo, file_sha256, mapped_gguf

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class WeightsMismatch(ShardError):
    """A shard file whose blocks are not the weights its metadata records (altered or damaged since it was cut)."""


def block_digests(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The sha256 (hex) of every block of the GGUF file at `path`, block 0 first: a whole model's layers, or
    a shard's stored blocks (its range, then its lookahead layers)."""
    path = pathlib.Path(path)
    with mapped_gguf(path) as (header, buffer), memoryview(buffer) as data:
        return tuple(_block_digest(tensors, data) for tensors in _blocks(path, header))


def verified_block_digests(info: ShardInfo) -> tuple[str, ...]:
    """block_digests of `info`'s file, which must equal what the file records (when it records digests: a
    whole model and an older shard do not); raises WeightsMismatch naming the first layer that differs."""
    found = block_digests(info.path)
    recorded = info.layer_sha256
    if recorded is None:
        return found
    for block, (expected, actual) in enumerate(zip(recorded, found, strict=True)):  # both: one per block (header.py)
        if expected != actual:
            raise WeightsMismatch(
                f"{info.path}: layer {info.shape.layer_start + block} (blk.{block} of this file) does not hold the "
                f"weights recorded for it when it was cut (sha256 {expected[:16]}..., found {actual[:16]}...): "
                "the file was altered or damaged; cut it again with kvpool shard"
            )
    return found


def verified_digests(info: ShardInfo) -> tuple[tuple[str, ...], str]:
    """verified_block_digests of `info` and its file's sha256 (file_sha256), computed side by side: a daemon's
    start-up needs both (its refusal the blocks, its identity the file), and hashlib lets go of the GIL over
    large buffers, so on two cores they take about the longer of the two instead of their sum (each grows
    with the shard; for the ~1B model's 208 MB middle shard in the page cache on a 2-core AMD EPYC 0.14-0.16 s
    side by side against 0.28-0.30 s one after the other, 0.40 s the first time: evidence/startup/README.md,
    "Stop 57"). WeightsMismatch as verified_block_digests and ShardError for a file that cannot be read, once
    the file's hash is done (the blocks' error first where both fail)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-file-sha256") as executor:
        whole = executor.submit(file_sha256, info.path)
        blocks = verified_block_digests(info)
        return blocks, whole.result()


def _blocks(path: pathlib.Path, header: GgufHeader) -> list[list[tuple[str, TensorInfo]]]:
    """(suffix, tensor) of each block 0 .. block_count - 1, sorted by suffix."""
    arch = header.values.get("general.architecture")
    block_count = header.values.get(f"{arch}.block_count")
    if not isinstance(block_count, int) or isinstance(block_count, bool) or block_count < 0:
        raise ShardError(f"{path} has no block count ({arch}.block_count)")
    blocks: list[list[tuple[str, TensorInfo]]] = [[] for _ in range(block_count)]
    for tensor in header.tensors:
        match = BLOCK_TENSOR.fullmatch(tensor.name)
        if match is None:
            continue
        index = int(match.group(1))
        if index >= block_count:
            raise ShardError(f"{path}: tensor {tensor.name} is past the file's {block_count} blocks")
        blocks[index].append((match.group(2), tensor))
    for block in blocks:
        block.sort(key=lambda item: item[0])
    return blocks


def _block_digest(tensors: list[tuple[str, TensorInfo]], data: memoryview) -> str:
    digest = hashlib.sha256()
    for suffix, tensor in tensors:
        name = suffix.encode()
        digest.update(_U64.pack(len(name)) + name + _U32.pack(tensor.ggml_type) + _U32.pack(len(tensor.dims)))
        digest.update(b"".join(_U64.pack(dim) for dim in tensor.dims) + _U64.pack(tensor.n_bytes))
        digest.update(data[tensor.offset : tensor.offset + tensor.n_bytes])
    return digest.hexdigest()

"""The start-up's two hashes of a shard file: the blocks' digests then the file's sha256 one after the other (as
kvpool serve took them before 1a08a25), against verified_digests (the two side by side); three rounds each."""
import pathlib
import sys
import time

from kvpool.shard.digests import verified_block_digests, verified_digests
from kvpool.shard.header import file_sha256, read_shard_info

info = read_shard_info(pathlib.Path(sys.argv[1]))
print(f"{info.path.name}: {info.path.stat().st_size} bytes")
for _ in range(3):
    started = time.perf_counter()
    serial = (verified_block_digests(info), file_sha256(info.path))
    middle = time.perf_counter()
    side_by_side = verified_digests(info)
    ended = time.perf_counter()
    assert serial == side_by_side
    print(f"one after the other {middle - started:.3f} s; side by side {ended - middle:.3f} s")

"""One sequence's KV state as bytes: saved from a context, restored into an empty sequence (llama.cpp's
llama_state_seq_get_data / llama_state_seq_set_data: only the cells the sequence uses).

Neither direction stages the bytes. A save has llama.cpp write into the bytes object it returns, created
uninitialised (PyBytes_FromStringAndSize(NULL, n), filled before anything else can see it, as C extensions
fill theirs); a restore hands llama.cpp the address of the caller's buffer (bytes, or the memoryview a
worker receives a restored state as: workers.server.pipe). Measured on the middle bundled shard, 512
positions (3.76 MiB; evidence/warm-tier/README.md, "Stop 36"): a zeroed bytearray, llama.cpp's write into it
and a bytes() copy took 2.3 + 0.6 + 1.9 ms, mostly page faults of the two fresh buffers; now 2.5-2.7 ms.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import llama_cpp
import numpy as np

from kvpool.state.shared import new_memfd

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTE_POINTER = ctypes.POINTER(ctypes.c_uint8)


class StateSizeMismatch(RuntimeError):
    """llama.cpp wrote another number of bytes than it said a sequence's state takes."""


def save_sequence(ctx: llama_cpp.llama_context_p, sequence: int) -> bytes:
    """The sequence's state; raises StateSizeMismatch if llama.cpp writes fewer bytes than it sized."""
    size = llama_cpp.llama_state_seq_get_size(ctx, sequence)
    blob = _new_bytes(None, size)
    written = llama_cpp.llama_state_seq_get_data(ctx, ctypes.cast(ctypes.c_char_p(blob), _BYTE_POINTER), size, sequence)
    if written != size:
        raise StateSizeMismatch(f"llama_state_seq_get_data wrote {written} of {size} bytes of sequence {sequence}")
    return blob


def save_sequence_to_memfd(ctx: llama_cpp.llama_context_p, sequence: int, head: int, tail: int) -> tuple[int, int]:
    """(memfd, payload bytes): the sequence's state written by llama.cpp straight into a new memfd (sealable:
    kvpool.state.shared) after `head` bytes, `tail` bytes after it, its pages allocated at once (MAP_POPULATE)
    rather than faulted one by one, and no mapping of it left behind. Raises StateSizeMismatch as
    save_sequence does (the memfd closed)."""
    size = llama_cpp.llama_state_seq_get_size(ctx, sequence)
    fd = new_memfd()
    try:
        os.ftruncate(fd, head + size + tail)
        if size:
            with mmap.mmap(fd, head + size + tail, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as mapping:
                window = (ctypes.c_uint8 * size).from_buffer(mapping, head)
                try:
                    written = llama_cpp.llama_state_seq_get_data(ctx, window, size, sequence)
                finally:
                    del window  # the mapping closes only once no view of it is left
            if written != size:
                raise StateSizeMismatch(f"llama_state_seq_get_data wrote {written} of {size} bytes of sequence {sequence}")
        return fd, size
    except BaseException:
        os.close(fd)
        raise


def restore_sequence(ctx: llama_cpp.llama_context_p, sequence: int, blob: bytes | memoryview) -> int:
    """The bytes llama.cpp read of `blob` into `sequence` (0: refused; the context's KV may then be corrupt)."""
    source = np.frombuffer(blob, dtype=np.uint8)  # no copy: a read-only view of the caller's bytes
    return llama_cpp.llama_state_seq_set_data(ctx, source.ctypes.data_as(_BYTE_POINTER), source.size, sequence)

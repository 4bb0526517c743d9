"""One sequence's KV state as bytes: saved from a context, restored into a fresh one (llama.cpp's
llama_state_seq_get_data / llama_state_seq_set_data: only the cells the sequence uses)."""

from __future__ import annotations

import ctypes

import llama_cpp


def save_sequence(ctx: llama_cpp.llama_context_p, sequence: int) -> bytes:
    size = llama_cpp.llama_state_seq_get_size(ctx, sequence)
    buffer = bytearray(size)
    written = llama_cpp.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(buffer), size, sequence)
    if written != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return bytes(buffer)


def restore_sequence(ctx: llama_cpp.llama_context_p, sequence: int, blob: bytes) -> bool:
    """False when llama.cpp refused the blob (the context's KV may then be corrupt: free it)."""
    source = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    return llama_cpp.llama_state_seq_set_data(ctx, source, len(blob), sequence) > 0

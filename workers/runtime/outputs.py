"""Where an append's output rows are written: a buffer the caller keeps (a worker reuses one across decode steps, so a
last shard's logits are not mapped and faulted in afresh every step), checked here, or a new array."""

from __future__ import annotations

import numpy as np

from workers.runtime.errors import BadInput


def output_array(out: np.ndarray | None, shape: tuple[int, int], *, length: int) -> np.ndarray:
    """`out` if it is a float32 C-contiguous array of `shape`, a new one if it is None; BadInput (with `length`, the
    sequence's) for any other."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise BadInput(f"output buffer must be float32 C-contiguous {shape}", length=length)
    return out

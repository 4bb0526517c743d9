"""Greedy generation over anything that appends token ids at a position and returns last-row logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

AppendTokens = Callable[[int, Sequence[int]], np.ndarray]


def greedy_tokens(
    append: AppendTokens,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    is_end: Callable[[int], bool] = lambda token: False,
    prefill_chunk: int = 0,
) -> Iterator[int]:
    """Yield up to max_new_tokens greedy tokens; stop after an end-of-generation token.

    `prefill_chunk` > 0 sends the prompt in chunks of that many tokens (the result must not change).
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    chunk = prefill_chunk if prefill_chunk > 0 else len(prompt)
    logits = None
    for start in range(0, len(prompt), chunk):
        logits = append(start, prompt[start : start + chunk])
    position = len(prompt)
    for _ in range(max_new_tokens):
        assert logits is not None
        token = int(np.argmax(logits[-1]))
        yield token
        if is_end(token):
            return
        logits = append(position, [token])
        position += 1

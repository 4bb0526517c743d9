"""Choosing the next token from one row of logits, on the last shard: greedy (exactly the argmax) or
seeded sampling (temperature, top-k, top-p), reproducible from (seed, position) alone; optionally the
top-n tokens with their log-probabilities (of the unscaled distribution). And what an append's reply carries
of its output (`answer`), whichever way the reply travels (the pipe's Appended, the direct channel's AppendReply)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.wire.sampling import Sampling


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    top_ids: list[int]
    top_logprobs: list[float]


def sample(logits: np.ndarray, sampling: Sampling, position: int) -> Sampled:
    """`logits`: float32 [n_vocab], the row of the token at `position` - 1 (so the drawn token lands at
    `position`); the random stream depends on (seed, position) only."""
    if sampling.temperature == 0:
        token = int(np.argmax(logits))
    else:
        scaled = logits.astype(np.float64) / sampling.temperature
        candidates = np.arange(scaled.size)
        if sampling.top_k:
            candidates = np.argpartition(-scaled, sampling.top_k - 1)[: sampling.top_k]
        order = candidates[np.lexsort((candidates, -scaled[candidates]))]  # by logit, ties by id: deterministic
        weights = np.exp(scaled[order] - scaled[order[0]])
        probabilities = weights / weights.sum()
        if sampling.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probabilities), sampling.top_p) + 1)
            order, probabilities = order[:keep], probabilities[:keep] / probabilities[:keep].sum()
        draw = np.random.default_rng([sampling.seed, position]).random()
        token = int(order[min(int(np.searchsorted(np.cumsum(probabilities), draw, side="right")), order.size - 1)])
    if not sampling.logprobs:
        return Sampled(token, [], [])
    values = logits.astype(np.float64)
    log_normalizer = values.max() + np.log(np.exp(values - values.max()).sum())
    top = np.argsort(-values, kind="stable")[: sampling.logprobs]
    return Sampled(token, [int(i) for i in top], [float(values[i] - log_normalizer) for i in top])


@dataclass(frozen=True, slots=True)
class Answer:
    """What a reply to an append carries of its output: `rows` (float32 [n, width]) and, when the append
    sampled, the token picked with its top-n (`reply_fields` as the reply structs name them)."""

    rows: np.ndarray
    token: int = -1
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    @property
    def reply_fields(self) -> dict[str, object]:
        return {"token": self.token, "top_ids": self.top_ids, "top_logprobs": self.top_logprobs}


def answer(output: np.ndarray, sampling: Sampling | None, length: int) -> Answer:
    """`output`: an append's result rows, the context now `length` long. Without `sampling`, every row; with it
    (the last shard), the token drawn from the last row (it lands at `length`), and the rows only when
    sampling.logits asks for them."""
    if sampling is None:
        return Answer(output)
    picked = sample(output[-1], sampling, length)
    return Answer(output if sampling.logits else output[:0], picked.token, picked.top_ids, picked.top_logprobs)

"""How the last shard picks the next token: on the wire in Append.sample, and on a worker's pipe (the picking
itself is workers.runtime.sampling)."""

from __future__ import annotations

import msgspec


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """How the last shard picks the next token (on the wire in Append.sample, and on the worker's pipe)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int = 0
    logprobs: int = 0  # how many top tokens to return with their log-probabilities
    logits: bool = False  # return the logits row too

    def problems(self, n_vocab: int) -> list[str]:
        found = []
        if not self.temperature >= 0:
            found.append("temperature must be >= 0")
        if not 0 <= self.top_k <= n_vocab:
            found.append(f"top_k must be in [0, {n_vocab}]")
        if not 0 < self.top_p <= 1:
            found.append("top_p must be in (0, 1]")
        if not 0 <= self.logprobs <= min(n_vocab, 100):
            found.append(f"logprobs must be in [0, {min(n_vocab, 100)}]")
        if not 0 <= self.seed < 2**63:
            found.append("seed must be in [0, 2^63)")
        return found

"""Does a prompt computed in several chunks give the same bits as the same prompt in one chunk? The whole
bundled model in process (workers.runtime.model.ShardModel, one thread, flash attention off), 96 random token
ids, the last row's logits of each partition against one 96-row prefill. README, "Shared prefixes", says what
it found on the CPU the evidence was recorded on (evidence/prefix/chunking-probe.txt).

    .venv/bin/python scripts/probe_chunking.py
"""

from __future__ import annotations

import platform

import numpy as np

from kvpool.shard.bundled import bundled_model_path
from workers.runtime.model import ShardModel

PARTITIONS = ([64, 32], [32, 64], [32, 32, 32], [80, 16], [92, 4], [93, 3], [94, 2], [95, 1], [1, 95], [2, 94])


def main() -> None:
    tokens = [int(token) for token in np.random.default_rng(0).integers(100, 20000, 96)]
    with ShardModel(bundled_model_path()) as model:

        def last_logits(partition: list[int]) -> np.ndarray:
            with model.new_context(512) as context:
                position, out = 0, None
                for rows in partition:
                    out = context.append(position, tokens=np.asarray(tokens[position : position + rows])).copy()
                    position += rows
                return out

        one = last_logits([96])
        print(f"cpu: {platform.processor() or platform.machine()}; whole bundled model, 1 thread; 96 tokens in one chunk against:")
        for partition in PARTITIONS:
            print(f"  {partition}: max |delta| of the last row's logits {float(np.abs(last_logits(partition) - one).max())}")


if __name__ == "__main__":
    main()

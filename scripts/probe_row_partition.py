"""Probe: are logits independent of how a prompt is partitioned into appends? (whole bundled model, CPU)

Prints, per chunk size, the max |Δ| of the last row's logits against one whole-prompt prefill, and per
row the max |Δ| between a row computed inside a multi-row prefill and the same row appended alone.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvpool.local.tokenizer import Tokenizer  # noqa: E402
from kvpool.shard.bundled import bundled_model_path  # noqa: E402
from workers.runtime.model import ShardModel  # noqa: E402


def main() -> int:
    path = bundled_model_path()
    with Tokenizer(path) as tokenizer:
        prompt = tokenizer.encode(tokenizer.chat_prompt("Tell me a long story about a dragon who lived under a mountain and collected books."))
    with ShardModel(path) as model:
        with model.new_context(512) as context:
            every_row = context.append(0, tokens=np.asarray(prompt), output_rows="all")
        print(f"prompt of {len(prompt)} tokens; reference: one prefill of all rows")
        print("| chunk size | max |Δ| of the last row |")
        print("|---|---|")
        for chunk in (1, 2, 3, 5, 8, 16):
            with model.new_context(512) as context:
                for start in range(0, len(prompt), chunk):
                    last = context.append(start, tokens=np.asarray(prompt[start : start + chunk]))
            print(f"| {chunk} | {np.abs(last[0] - every_row[-1]).max():.6g} |")
        with model.new_context(512) as context:
            differing = []
            for row, token in enumerate(prompt):
                alone = context.append(row, tokens=np.asarray([token]))
                differing.append(float(np.abs(alone[0] - every_row[row]).max()))
        first_diff = next((row for row, delta in enumerate(differing) if delta > 0), None)
        print(f"one row at a time: rows 0..{len(prompt) - 1}, first row that differs: {first_diff}, max |Δ| {max(differing):.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

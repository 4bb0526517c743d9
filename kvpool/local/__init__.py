"""The in-process chain behind `kvpool generate`: shards run one after another in this process, greedy
decoding, and text."""

from kvpool.local.chain import LocalChain
from kvpool.local.generate import greedy_tokens
from kvpool.local.tokenizer import Tokenizer

__all__ = ["LocalChain", "Tokenizer", "greedy_tokens"]

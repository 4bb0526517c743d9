"""The in-process chain behind `kvpool generate`: shards run one after another in this process, greedy
decoding, and text."""

"""Shard files: a GGUF model cut into layer ranges (written byte for byte, read back by header), the bundled
model, the cache of cut shards, and the check that shards make a whole route."""

"""kvpool: shard-local hot KV state manager for distributed llama.cpp inference."""

__version__ = "0.1.0"

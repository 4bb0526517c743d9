"""kvpool: shard-local hot KV state manager for distributed llama.cpp inference."""

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "ConnectionLost", "KvpoolError", "Sampling", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kvpool` stays cheap for the worker processes, which never use the clients.
    if name in ("AsyncClient", "Client", "ConnectionLost", "KvpoolError"):
        import kvpool.client

        return getattr(kvpool.client, name)
    if name == "Sampling":
        from kvpool.wire.sampling import Sampling

        return Sampling
    raise AttributeError(name)

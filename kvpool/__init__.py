"""kvpool: shard-local hot KV state manager for distributed llama.cpp inference."""

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "KvpoolError", "Sampling", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kvpool` stays cheap for the worker processes, which never use the clients.
    if name in ("Client", "KvpoolError"):
        from kvpool import client

        return getattr(client, name)
    if name == "Sampling":
        from workers.sampling import Sampling

        return Sampling
    if name == "AsyncClient":
        from kvpool import async_client

        return async_client.AsyncClient
    raise AttributeError(name)

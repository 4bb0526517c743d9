"""kvpool: shard-local hot KV state manager for distributed llama.cpp inference.

The public names: the clients of one daemon (Client, AsyncClient, their errors), the router of a route of
daemons (Router) and the sampling settings (Sampling). Every other import names its module."""

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "ConnectionLost", "KvpoolError", "Router", "Sampling", "__version__"]

_PUBLIC = {
    "AsyncClient": "kvpool.client.aio", "Client": "kvpool.client.client", "ConnectionLost": "kvpool.client.messages",
    "KvpoolError": "kvpool.client.messages", "Router": "kvpool.router.router", "Sampling": "kvpool.wire.sampling",
}


def __getattr__(name: str):
    # Lazy: `import kvpool` stays cheap for the worker processes, which never use the clients.
    if name not in _PUBLIC:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)

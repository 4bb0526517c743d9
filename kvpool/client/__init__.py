"""Clients of one daemon: `Client` (synchronous, with its sessions' direct channels) and `AsyncClient` (many
requests in flight on one connection), built on one set of request and reply functions."""

from kvpool.client.aio import AsyncClient
from kvpool.client.client import Client
from kvpool.client.messages import AppendResult, ConnectionLost, KvpoolError

__all__ = ["AppendResult", "AsyncClient", "Client", "ConnectionLost", "KvpoolError"]

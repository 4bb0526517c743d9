"""Clients of one daemon: `Client` (synchronous, with its sessions' direct channels) and `AsyncClient` (many
requests in flight on one connection), built on one set of request and reply functions."""

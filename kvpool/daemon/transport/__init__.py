"""The daemon's socket: the listening socket and its connection limit, framing with deadlines, the bound on
request bytes held across connections, and a connection's requests in flight."""

from kvpool.daemon.transport.frames import SocketTransport
from kvpool.daemon.transport.listener import SocketSetupError, prepare_socket_path

__all__ = ["SocketTransport", "SocketSetupError", "prepare_socket_path"]

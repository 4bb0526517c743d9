"""The daemon's socket: the listening socket and its connection limit, framing with deadlines, the bound on
request bytes held across connections, and a connection's requests in flight."""

from kvpool.daemon.transport.frames import FrameServer
from kvpool.daemon.transport.listener import SocketSetupError, prepare_socket_path

__all__ = ["FrameServer", "SocketSetupError", "prepare_socket_path"]

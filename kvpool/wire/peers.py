"""Who may talk to a kvpool socket: every one of them (a daemon's, a worker's direct channel) serves peers
of its own user only, as the kernel reports them (SO_PEERCRED), whatever the socket's file mode."""

from __future__ import annotations

import os
import socket
import struct

PEER_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The pid, uid and gid of the process at the other end of a connected Unix socket."""
    return PEER_CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size))


def same_user(sock: socket.socket) -> bool:
    """The peer runs as this process's uid."""
    _pid, uid, _gid = peer_credentials(sock)
    return uid == os.getuid()

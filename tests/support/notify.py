"""A service manager's end of NOTIFY_SOCKET for tests: what a daemon told it, and whether its socket answered
when it said READY."""

from __future__ import annotations

import pathlib
import socket
import threading

from kvpool.client.client import Client, ConnectionLost
from kvpool.daemon.notify import socket_address
from tests.support.daemons import HANG_GUARD_S


class NotifyListener:
    """A bound datagram socket standing in for systemd. Each datagram is recorded with whether a client
    could connect to (and handshake with) `daemon_socket` at the moment it arrived."""

    def __init__(self, address: str, daemon_socket: pathlib.Path) -> None:
        self.address = address
        self.daemon_socket = daemon_socket
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(address))
        self.sock.settimeout(0.2)
        self.datagrams: list[tuple[str, bool]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            message = data.decode()
            answered = self._answers() if "READY=1" in message.splitlines() else False
            self.datagrams.append((message, answered))

    def _answers(self) -> bool:
        try:
            Client(self.daemon_socket, timeout_s=HANG_GUARD_S, direct=False).close()
        except ConnectionLost:
            return False
        return True

    def lines(self) -> list[str]:
        return [line for message, _ in list(self.datagrams) for line in message.splitlines()]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(HANG_GUARD_S)
        self.sock.close()
        if not self.address.startswith("@"):
            pathlib.Path(self.address).unlink(missing_ok=True)

"""The service manager's side channel: systemd's sd_notify protocol, with the standard library only.

A service manager that starts `kvpool serve` with NOTIFY_SOCKET set (systemd with Type=notify) is sent
one datagram per event on that Unix datagram socket: `STATUS=...` at start-up milestones, `READY=1` once the
daemon's socket accepts and its start-up work is done, `STOPPING=1` when stopping begins. Without an address
every call is a no-op. Contract: no call ever raises into the daemon; the first failed send is logged (one
line), later ones are not.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger("kvpool.serve")

SEND_TIMEOUT_S = 1.0  # a manager that reads its socket never keeps a datagram waiting; this bounds one that does not


class Notifier:
    """Sends sd_notify datagrams to `address` (NOTIFY_SOCKET: an absolute path, or '@name' for an abstract
    socket); `address` None or empty: sends nothing."""

    def __init__(self, address: str | None) -> None:
        self.address = address or ""
        self._failure_logged = False
        self._stopping_sent = False

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def status(self, text: str) -> None:
        self.send(f"STATUS={one_line(text)}")

    def ready(self, text: str) -> None:
        self.send(f"READY=1\nSTATUS={one_line(text)}")

    def stopping(self) -> None:
        """STOPPING=1, once however often stopping is asked for (a second signal stops at once, not twice)."""
        if self._stopping_sent:
            return
        self._stopping_sent = True
        self.send("STOPPING=1\nSTATUS=stopping")

    def send(self, message: str) -> None:
        if not self.enabled:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(message.encode(), socket_address(self.address))
        except (OSError, ValueError) as error:
            self._log_failure(error)

    def _log_failure(self, error: Exception) -> None:
        if self._failure_logged:
            return
        self._failure_logged = True
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        log.warning("cannot notify the service manager on NOTIFY_SOCKET=%s: %s (later failures are not logged)", self.address, reason)


def socket_address(address: str) -> str | bytes:
    """NOTIFY_SOCKET as sendto() takes it: '@name' is the abstract socket NUL+name, '/path' a path;
    anything else (a relative path, systemd's vsock: form) is a ValueError."""
    if address.startswith("@"):
        return b"\0" + address[1:].encode()
    if address.startswith("/"):
        return address
    raise ValueError(f"unsupported address (an absolute path or @abstract name expected): {address!r}")


def one_line(text: str) -> str:
    """A STATUS= value: the protocol separates assignments by newlines."""
    return " ".join(text.split())

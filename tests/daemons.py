"""Daemons for tests: kvpool.launcher.Daemon plus the checks a test wants when one stops."""

from __future__ import annotations

import os
import pathlib
import signal

import psutil

from kvpool.launcher import Daemon


class DaemonProcess(Daemon):
    """A started, ready daemon; stop() also asserts its workers are gone and its socket removed."""

    def __init__(self, model: pathlib.Path, socket_path: pathlib.Path, *options: str) -> None:
        super().__init__(model, socket_path, options)
        self.wait_ready()

    def stop(self, *, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        pids = self.worker_pids()
        code = super().stop(sig=sig, timeout_s=timeout_s)
        _gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
        assert not alive, f"orphan worker processes: {[p.pid for p in alive]}"
        assert not self.socket.exists(), "socket file left behind"
        return code


def private_socket_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A short, private directory for sockets (Unix socket paths are limited to 107 bytes)."""
    directory = pathlib.Path("/tmp") / f"kvpool-test-{os.getpid()}-{abs(hash(tmp_path)) % 10**8}"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory

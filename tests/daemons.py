"""Real `kvpool serve` processes for tests: start, wait for the socket, connect, stop, check nothing is left."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil

from kvpool.client import Client, ConnectionLost

START_TIMEOUT_S = 120.0


class DaemonProcess:
    """One `python -m kvpool serve` child; stop() shuts it down and asserts nothing is left behind."""

    def __init__(self, model: pathlib.Path, socket_path: pathlib.Path, *options: str) -> None:
        self.model = model
        self.socket = socket_path
        self.log_path = socket_path.with_suffix(".log")
        self._log = open(self.log_path, "wb")
        command = [sys.executable, "-m", "kvpool", "serve", "--model", str(model), "--socket", str(socket_path), *options]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    Client(self.socket, timeout_s=10).close()
                    return
                except ConnectionLost:
                    pass
            time.sleep(0.05)
        self.process.kill()
        raise RuntimeError(f"daemon did not start within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> Client:
        return Client(self.socket, **kwargs)

    def worker_pids(self) -> list[int]:
        try:
            return [child.pid for child in psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, *, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Stop the daemon; assert its workers are gone and the socket file removed. Returns the exit code."""
        pids = self.worker_pids()
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"daemon did not stop within {timeout_s} s:\n{self.log()}")
        finally:
            self._log.close()
        _gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
        assert not alive, f"orphan worker processes: {[p.pid for p in alive]}"
        assert not self.socket.exists(), "socket file left behind"
        return code


def private_socket_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A short, private directory for sockets (Unix socket paths are limited to 107 bytes)."""
    directory = pathlib.Path("/tmp") / f"kvpool-test-{os.getpid()}-{abs(hash(tmp_path)) % 10**8}"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory

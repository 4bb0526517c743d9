"""Start and stop `kvpool serve` daemons as child processes (used by `kvpool demo`, the stress script,
the benchmarks and the tests)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

from kvpool.client.client import Client, ConnectionLost

# A hang guard, never a verdict on speed: a daemon's start-up (its workers, its measurements) takes seconds on
# a quiet machine and may take minutes on a slow, busy one; while it is waited for, progress is printed.
START_HANG_GUARD_S = 1800.0
PROGRESS_EVERY_S = 15.0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class DaemonStartFailed(RuntimeError):
    pass


class Daemon:
    """One `python -m kvpool serve` child; its log goes to <socket>.log. stop() is idempotent.

    The daemon holds the read end of a pipe whose write end only this process holds (its lifeline,
    see kvpool.daemon.lifeline): if this process dies, by any signal, the daemon and its workers stop too.
    """

    def __init__(self, model: pathlib.Path, socket_path: pathlib.Path, options: Sequence[str] = ()) -> None:
        self.model = pathlib.Path(model)
        self.socket = pathlib.Path(socket_path)
        self.log_path = self.socket.with_suffix(".log")
        self._log = open(self.log_path, "wb")
        lifeline_read, self._lifeline = os.pipe()  # both ends close-on-exec; pass_fds hands over the read end
        try:
            command = [
                sys.executable, "-m", "kvpool", "serve", "--model", str(model), "--socket", str(socket_path),
                "--lifeline-fd", str(lifeline_read), *options,
            ]
            self.process = subprocess.Popen(
                command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(lifeline_read,)
            )
        except BaseException:
            os.close(self._lifeline)
            self._log.close()
            raise
        finally:
            os.close(lifeline_read)
        self.exit_code: int | None = None

    def wait_ready(self, timeout_s: float = START_HANG_GUARD_S, *, say=_to_stderr) -> None:
        """Until the daemon answers on its socket; every PROGRESS_EVERY_S, `say` where its start-up stands
        (its last log line). DaemonStartFailed if it exits, or if it hangs past the guard `timeout_s`."""
        started = time.monotonic()
        deadline = started + timeout_s
        next_note = started + PROGRESS_EVERY_S
        while time.monotonic() < deadline:
            if time.monotonic() >= next_note:
                next_note += PROGRESS_EVERY_S
                last = (self.log().strip().splitlines() or ["(nothing logged yet)"])[-1]
                say(f"kvpool: waiting for the daemon of {self.model.name} to start ({time.monotonic() - started:.0f} s): {last}")
            if self.process.poll() is not None:
                raise DaemonStartFailed(f"daemon for {self.model.name} exited with {self.process.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    Client(self.socket, timeout_s=10).close()
                    return
                except ConnectionLost:
                    pass
            time.sleep(0.05)
        self.stop(sig=signal.SIGKILL)
        raise DaemonStartFailed(f"daemon for {self.model.name} did not start within the hang guard of {timeout_s:.0f} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
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
        """Signal the daemon and wait; kill it after timeout_s. Returns its exit code."""
        if self.exit_code is not None:
            return self.exit_code
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.exit_code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_code = self.process.wait()
        finally:
            self._log.close()
            self._close_lifeline()
        return self.exit_code

    def _close_lifeline(self) -> None:
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1


def start_daemons(
    models: Sequence[pathlib.Path],
    socket_dir: pathlib.Path,
    options: Sequence[str] | Sequence[Sequence[str]] = (),
    *,
    prefix: str = "shard",
) -> list[Daemon]:
    """Start one daemon per model (all at once) and wait until all answer; on failure stop them all.

    `options` are `kvpool serve` flags for every daemon, or one list of flags per daemon.
    """
    per_daemon = [list(o) for o in options] if options and not isinstance(options[0], str) else [list(options)] * len(models)
    if len(per_daemon) != len(models):
        raise ValueError(f"{len(per_daemon)} option lists for {len(models)} daemons")
    socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(socket_dir, 0o700)
    daemons: list[Daemon] = []
    try:
        for index, (model, flags) in enumerate(zip(models, per_daemon)):
            daemons.append(Daemon(model, socket_dir / f"{prefix}{index}.sock", flags))
        for daemon in daemons:
            daemon.wait_ready()
    except BaseException:
        for daemon in daemons:
            daemon.stop()
        raise
    return daemons

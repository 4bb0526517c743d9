"""Start and stop `kvpool serve` daemons as child processes (used by `kvpool demo`, the stress script,
the benchmarks and the tests)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import psutil

from kvpool.client.client import Client, ConnectionLost
from kvpool.daemon.keep_warm import SPINNER_MODULE

# A hang guard, never a verdict on speed: a daemon's start-up (its workers, its measurements) takes seconds on
# a quiet machine and may take minutes on a slow, busy one; while it is waited for, progress is printed.
START_HANG_GUARD_S = 1800.0
PROGRESS_EVERY_S = 15.0
POLL_S = 0.05
HANDSHAKE_TIMEOUT_S = 10.0  # one readiness check's connect and Hello


def not_answering(socket_path: pathlib.Path) -> str | None:
    """Why the daemon on `socket_path` is not ready (None: it answered the handshake). A daemon opens its
    socket only once its start-up work is done, so an answer means it serves."""
    if not socket_path.exists():
        return "no socket there yet"
    try:
        Client(socket_path, timeout_s=HANDSHAKE_TIMEOUT_S).close()
    except ConnectionLost as error:
        return str(error)
    return None


def wait_answering(
    socket_path: pathlib.Path,
    timeout_s: float,
    *,
    progress_every_s: float,
    progress: Callable[[float, str], None],
    check: Callable[[], None] = lambda: None,
) -> str | None:
    """Poll `not_answering` until the daemon answers (None) or `timeout_s` passed (the last reason). Every
    `progress_every_s`, progress(seconds waited, reason); `check` runs each poll and may raise to give up."""
    started = time.monotonic()
    next_note = started + progress_every_s
    while True:
        check()
        reason = not_answering(socket_path)
        now = time.monotonic()
        if reason is None or now - started >= timeout_s:
            return reason
        if now >= next_note:
            next_note += progress_every_s
            progress(now - started, reason)
        time.sleep(min(POLL_S, max(0.0, started + timeout_s - now)))


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _is_spinner(process: psutil.Process) -> bool:
    try:
        return SPINNER_MODULE in process.cmdline()
    except psutil.Error:
        return False


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

        def progress(waited_s: float, _reason: str) -> None:
            last = (self.log().strip().splitlines() or ["(nothing logged yet)"])[-1]
            say(f"kvpool: waiting for the daemon of {self.model.name} to start ({waited_s:.0f} s): {last}")

        if wait_answering(self.socket, timeout_s, progress_every_s=PROGRESS_EVERY_S, progress=progress, check=self._check_running) is None:
            return
        self.stop(sig=signal.SIGKILL)
        raise DaemonStartFailed(f"daemon for {self.model.name} did not start within the hang guard of {timeout_s:.0f} s:\n{self.log()}")

    def _check_running(self) -> None:
        if self.process.poll() is not None:
            raise DaemonStartFailed(f"daemon for {self.model.name} exited with {self.process.returncode}:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> Client:
        return Client(self.socket, **kwargs)

    def worker_pids(self) -> list[int]:
        """The daemon's descendants but its --keep-warm spinners (kvpool.daemon.keep_warm): the workers, and
        multiprocessing's resource tracker."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [child.pid for child in children if not _is_spinner(child)]

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

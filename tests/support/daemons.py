"""Daemons for tests: kvpool.launcher.Daemon plus the checks a test wants when one stops, waits for events
with hang guards only (a stopped worker keeps a request in flight on any machine), and a way to run a
kvpool command that starts daemons of its own."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pathlib
import signal
import socket
import struct
import subprocess
import termios
import threading
import time

import psutil
import pytest

from kvpool.client.client import Client, KvpoolError
from kvpool.launcher import Daemon, DaemonStartFailed
from kvpool.stress.processes import say_on_stderr, wait_gone
from kvpool.wire.framing import FRAME_HEADER, receive_frame
from kvpool.wire.protocol import MAX_REPLY_BYTES, PROTOCOL_VERSION, Hello, decode_reply, encode
from workers.server import compute_semaphore

# Hang guards only, far above what the slowest, busiest machine needs (a daemon starts in a few seconds
# and stops in under one on 2 quiet cores): a slow start or stop must never fail a test by itself.
START_HANG_GUARD_S = 900.0
STOP_HANG_GUARD_S = 300.0
HANG_GUARD_S = 600.0  # any other wait for an event that takes well under a second on 2 quiet cores


class DaemonProcess(Daemon):
    """A started, ready daemon; stop() also asserts its workers are gone and its socket removed."""

    def __init__(self, model: pathlib.Path, socket_path: pathlib.Path, *options: str) -> None:
        super().__init__(model, socket_path, options)
        self.wait_ready(timeout_s=START_HANG_GUARD_S)

    def stop(self, *, sig: int = signal.SIGTERM, timeout_s: float = STOP_HANG_GUARD_S) -> int:
        children = []
        for pid in self.worker_pids():
            try:
                children.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        code = super().stop(sig=sig, timeout_s=timeout_s)
        alive = exited_all(children, "the daemon's workers and resource tracker")
        assert not alive, f"orphan worker processes: {[p.pid for p in alive]}"
        assert not self.socket.exists(), "socket file left behind"
        return code


# ---- waiting for events, never for time -----------------------------------------------------------


def wait_until(predicate, what: str, timeout_s: float = HANG_GUARD_S):
    """Poll `predicate` until it returns something true, and return that; the timeout is a hang guard."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: waited {timeout_s:.0f} s for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def stopped(pid: int):
    """The process `pid` (a worker) is stopped inside the block: a command sent to it stays in flight for
    as long as the test wants, on any machine, and completes once the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def exited_all(processes: list[psutil.Process], what: str, timeout_s: float = STOP_HANG_GUARD_S) -> list[psutil.Process]:
    """Until every process is gone or a zombie, under a hang guard; those still running then. Not
    psutil.wait_procs: the workers of a stopped daemon are orphans, and an orphan's zombie stays until init
    reaps it (on a Firecracker VM's init: 1.2-1.4 s after the daemon's exit, measured), which is no wait of
    theirs."""
    return wait_gone(processes, what, say_on_stderr, hang_guard_s=timeout_s).left_alive


def exited(pid: int) -> bool:
    """The process is gone, or a zombie (it runs no more; its parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def in_thread(call) -> tuple[threading.Thread, dict]:
    """Run `call` in a started thread; the dict gets "result" or "error"."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as error:  # noqa: BLE001
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def joined(thread: threading.Thread, outcome: dict) -> dict:
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), f"hang guard: the request was still running after {HANG_GUARD_S:.0f} s"
    return outcome


def result(thread: threading.Thread, outcome: dict):
    """What the call in the thread returned (its exception is raised here)."""
    if "error" in joined(thread, outcome):
        raise outcome["error"]
    return outcome["result"]


def private_socket_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A short, private directory for sockets (Unix socket paths are limited to 107 bytes)."""
    directory = pathlib.Path("/tmp") / f"kvpool-test-{os.getpid()}-{abs(hash(tmp_path)) % 10**8}"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return members


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid} {' '.join(process.cmdline()[:5])}"
    except psutil.Error:
        return str(process.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_to_completion(command: list[str], *, timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) in a process group of its own.

    `timeout_s` is a hang guard: when it fires, the whole group (the command, the daemons it started and
    their workers) is killed, not only the command, and the test fails. After a normal exit nothing of
    the group may be left running (a program stops the daemons it started): leftovers fail the test.
    """
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            stdout, stderr = process.communicate()
            pytest.fail(f"hang guard: {' '.join(command[1:])} still running after {timeout_s:.0f} s\n{stderr[-4000:]}")
        except BaseException:  # the test's own timeout, Ctrl-C: take the group down with the test
            _kill_group(process.pid)
            raise
    leftovers = _group_members(process.pid)
    alive = exited_all(leftovers, f"what {command[1:3]} left", timeout_s=60)  # hang guard: stragglers normally exit at once
    if alive:
        described = [_describe(p) for p in alive]
        _kill_group(process.pid)
        pytest.fail(f"{' '.join(command[1:])} exited ({process.returncode}) and left processes running: {described}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# ---- raw frames on a daemon's socket ----------------------------------------------------------------


def raw_connection(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANG_GUARD_S)
    sock.connect(str(path))
    return sock


def read_reply(sock: socket.socket):
    """The next reply frame, decoded; None when the daemon closed the connection between frames."""
    payload = receive_frame(sock, MAX_REPLY_BYTES)
    return None if payload is None else decode_reply(payload)


def unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on this Unix socket that the peer has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def sent_and_read(path, request) -> socket.socket:
    """A new connection that has sent `request`, once the daemon has read every byte of it (not only
    received it): the daemon is then handling it. The reply is the caller's to read."""
    sock = raw_connection(path)
    sock.sendall(encode(Hello(version=PROTOCOL_VERSION)))
    assert read_reply(sock).version == PROTOCOL_VERSION
    sock.sendall(encode(request))
    wait_until(lambda: unread_bytes(sock) == 0, f"the daemon to read {type(request).__name__}")
    return sock


class RawConnection:
    def __init__(self, path, *, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(HANG_GUARD_S)
        self.sock.connect(str(path))
        if hello:
            self.sock.sendall(encode(Hello(version=PROTOCOL_VERSION, client="test")))
            assert self.read().version == PROTOCOL_VERSION

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self):
        """The next reply, or None once the daemon has closed the connection."""
        header = self._exactly(FRAME_HEADER.size)
        if header is None:
            return None
        (size,) = FRAME_HEADER.unpack(header)
        payload = self._exactly(size)
        assert payload is not None, "connection closed in the middle of a reply"
        return decode_reply(payload)

    def _exactly(self, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            try:
                chunk = self.sock.recv(size - len(data))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                assert not data, "connection closed in the middle of a frame"
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def admission_line_full(client: Client) -> bool:
    """A probe admission (admit_timeout_s 0: it waits for nothing) is refused for a full line, or for room."""
    try:
        client.append("probe", 1, 0, tokens=[1])
    except KvpoolError as refused:
        assert refused.code == "over_budget", refused
        return "the line's limit" in str(refused)
    raise AssertionError("the probe was admitted: the only place is not held")


# ---- what a request or a start was answered ------------------------------------------------------------


def refused(call) -> KvpoolError:
    """The typed error `call()` raises (it must raise one)."""
    with pytest.raises(KvpoolError) as raised:
        call()
    return raised.value


def checked(client):
    """The daemon's stats, its books balanced."""
    stats = client.stats()
    assert stats.integrity == "ok", stats.integrity
    return stats


def refused_start(model: pathlib.Path, socket_path: pathlib.Path, *options: str) -> str:
    """The log of a `kvpool serve` that exited before it served: exit status 2, no traceback."""
    daemon = Daemon(model, socket_path, list(options))
    try:
        with pytest.raises(DaemonStartFailed):
            daemon.wait_ready(timeout_s=START_HANG_GUARD_S)
    finally:
        code = daemon.stop()
    log = daemon.log()
    assert code == 2 and "Traceback" not in log, log
    return log


# ---- asyncio ------------------------------------------------------------------------------------------


def run_async(coroutine):
    """asyncio.run under the hang guard."""
    return asyncio.run(asyncio.wait_for(coroutine, HANG_GUARD_S))


async def poll(predicate, what: str):
    """await predicate() until it returns something true, and return that; the guard only stops a hang."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not (value := await predicate()):
            await asyncio.sleep(0.01)
    return value


def semaphore_listed(semaphore_id: int) -> bool:
    """Whether the kernel still lists this System V semaphore (a daemon's compute semaphore: workers.server.compute_semaphore)."""
    return compute_semaphore._listed_as(semaphore_id) != ""

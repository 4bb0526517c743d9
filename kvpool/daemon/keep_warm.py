"""Keeping the CPUs awake between a session's requests (`kvpool serve --keep-warm SECONDS`).

A route's decode step wakes every shard's worker once: it waits, blocked, while the other shards compute, and its
CPU, with nothing else to run, halts; the whole model in one process never blocks and never halts its CPU. On a
2-core KVM guest (AMD EPYC) the ~1B route of 3 daemons, the whole model in one process taking turns with it, read
0.926 and 0.9435 of the whole model (medians of two series) with the CPUs left to halt, 0.951 and 0.9515 with this,
ahead in 11 of 14 alternated pairs (evidence/daemon-overhead/README.md, "Stop 49"): a small gain against that host's
spread, presumably the halted CPU's wake-up (not traced), which would grow with the model: the longer the other
shards compute, the longer a CPU sleeps.

So after each session request (its end: kvpool.daemon.gate.Gate.leave, and every append on a worker's direct
channel) the daemon keeps one spinner process on each CPU it may run on busy for --keep-warm seconds: pinned to
its CPU, SCHED_IDLE (the kernel runs it only when nothing else wants that CPU, and any task that wakes there takes
the CPU from it at once), so a worker or a client that wakes finds its CPU running. One spinner a CPU for the whole
machine: a spinner spins only while it holds its CPU's lock (a file in the temporary directory, flock), so the
daemons of a route on one machine do not stack spinners on a CPU; the others wait for the lock asleep in the kernel
(a spinner that woke every few milliseconds to try again cost the computing worker its CPU now and then). Past the
window the spinners sleep (a look every IDLE_CHECK_S). 0 turns it off (no spinner is started). A spinner dies with
its daemon (PR_SET_PDEATHSIG, and a look at its parent while it spins or sleeps).

The block the spinners watch and the requests touch: workers.server.keep_warm_stamp."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import mmap
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory

from workers.server.keep_warm_stamp import ASLEEP, BLOCK_BYTES, MAX_SPINNERS, SPINNING, WAITING, Stamp

IDLE_CHECK_S = 0.05  # how often a sleeping spinner looks at the stamp (and at its parent): it spins within this of a request
SPIN_CHECK_EVERY = 2000  # loop turns between two looks at the stamp while spinning (a few microseconds)
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>
STATE_WORDS = {ASLEEP: "asleep", WAITING: "waiting for its CPU", SPINNING: "spinning"}


def lock_path(cpu: int) -> pathlib.Path:
    """The machine's lock for CPU `cpu`: whichever spinner holds it spins there."""
    return pathlib.Path(tempfile.gettempdir()) / f"kvpool-keep-warm-cpu{cpu}.lock"


class KeepWarm:
    """The supervisor's side: the block (a shared-memory segment its workers attach by name) and the spinners."""

    def __init__(self, window_s: float, cpus: list[int] | None = None) -> None:
        self.window_s = window_s
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))[:MAX_SPINNERS] if window_s > 0 else []
        self._block = shared_memory.SharedMemory(create=True, size=BLOCK_BYTES) if window_s > 0 else None
        self.stamp = Stamp(self._block.buf) if self._block is not None else None
        self._spinners: list[subprocess.Popen] = []

    @property
    def name(self) -> str:
        """The block's name for the workers ("": keeping warm is off)."""
        return self._block.name if self._block is not None else ""

    def start(self) -> None:
        """One spinner process per CPU (nothing when off)."""
        for slot, cpu in enumerate(self.cpus):
            command = [
                sys.executable, "-m", "kvpool.daemon.keep_warm", "--block", self.name, "--slot", str(slot), "--cpu", str(cpu),
                "--window", repr(self.window_s), "--parent", str(os.getpid()),
            ]
            self._spinners.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True))

    def touch(self) -> None:
        if self.stamp is not None:
            self.stamp.touch()

    def pids(self) -> list[int]:
        return [spinner.pid for spinner in self._spinners]

    def describe(self) -> str:
        """For `kvpool status`: the setting and what each spinner does now."""
        if self.stamp is None:
            return "off (--keep-warm 0)"
        states = ", ".join(
            f"cpu {cpu} {STATE_WORDS.get(self.stamp.state(slot), '?') if spinner.poll() is None else 'exited'}"
            for slot, (cpu, spinner) in enumerate(zip(self.cpus, self._spinners))
        )
        last = self.stamp.last_request
        since = f"the last session request ended {time.monotonic() - last:.3f} s ago" if last else "no session request yet"
        return f"{self.window_s:g} s after each session request, one idle-priority spinner a CPU ({states or 'none started'}); {since}"

    def close(self) -> None:
        """Stop the spinners and free the block; idempotent."""
        for spinner in self._spinners:
            with contextlib.suppress(OSError):
                spinner.kill()
        for spinner in self._spinners:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spinner.wait(timeout=5.0)
        self._spinners = []
        if self._block is not None:
            self.stamp.release()
            self._block.close()
            with contextlib.suppress(FileNotFoundError):
                self._block.unlink()
            self._block = None
            self.stamp = None


def _attach(name: str) -> mmap.mmap:
    """The block by its name, mapped without multiprocessing's resource tracker (this process is not one of the
    supervisor's multiprocessing children: a tracker of its own would unlink the block when it exits)."""
    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        return mmap.mmap(fd, BLOCK_BYTES)
    finally:
        os.close(fd)


def spin(stamp: Stamp, slot: int, cpu: int, window_s: float, parent: int) -> None:
    """The spinner's life: asleep while the stamp is older than the window; else, holding its CPU's lock, busy
    until it is. Returns when its parent is gone."""
    try:
        lock = os.open(lock_path(cpu), os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        lock = -1  # the lock cannot be had here: spin without it
    while os.getppid() == parent:
        if time.monotonic() - stamp.last_request > window_s:
            stamp.set_state(slot, ASLEEP)
            time.sleep(IDLE_CHECK_S)
            continue
        if lock >= 0:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                stamp.set_state(slot, WAITING)
                fcntl.flock(lock, fcntl.LOCK_EX)  # asleep in the kernel until the holder lets go
                if time.monotonic() - stamp.last_request > window_s:
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    continue
        stamp.set_state(slot, SPINNING)
        try:
            while time.monotonic() - stamp.last_request <= window_s and os.getppid() == parent:
                for _ in range(SPIN_CHECK_EVERY):
                    pass
        finally:
            if lock >= 0:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _die_with_parent() -> None:
    """SIGKILL from the kernel when the daemon's thread that started this process ends (the daemon's end: KeepWarm
    starts its spinners from the supervisor's loop), even while blocked waiting for a CPU's lock."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpool.daemon.keep_warm", description="one spinner of `kvpool serve --keep-warm` (started by the daemon)")
    parser.add_argument("--block", required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--cpu", type=int, required=True)
    parser.add_argument("--window", type=float, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent:
        return
    os.sched_setaffinity(0, {args.cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(KeyboardInterrupt):
        spin(Stamp(_attach(args.block)), args.slot, args.cpu, args.window, args.parent)


if __name__ == "__main__":
    main()

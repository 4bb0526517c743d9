"""One spinner of `kvpool serve --keep-warm` (kvpool.daemon.keep_warm), a process of its own started by the daemon:
pinned to its CPU, at SCHED_IDLE, busy while the daemon's last session request ended within the window and it holds
its CPU's lock, asleep else. It imports no more than it needs: one interpreter a CPU a daemon."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import mmap
import os
import pathlib
import signal
import tempfile
import time

from workers.server.keep_warm_stamp import ASLEEP, BLOCK_BYTES, SPINNING, WAITING, Stamp

IDLE_CHECK_S = 0.05  # how often a sleeping spinner looks at the stamp (and at its parent): it spins within this of a request
SPIN_CHECK_EVERY = 2000  # loop turns between two looks at the stamp and the parent while spinning (tens of microseconds)
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def lock_path(cpu: int) -> pathlib.Path:
    """The machine's lock for CPU `cpu`, in the temporary directory: whichever spinner holds it spins there (one
    spinner a CPU for the daemons that share that directory; a daemon with a private one, such as systemd's
    PrivateTmp, spins beside the others)."""
    return pathlib.Path(tempfile.gettempdir()) / f"kvpool-keep-warm-cpu{cpu}.lock"


def _attach(name: str) -> mmap.mmap:
    """The block by its name, mapped without multiprocessing's resource tracker (this process is not one of the
    supervisor's multiprocessing children: a tracker of its own would unlink the block when it exits)."""
    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        return mmap.mmap(fd, BLOCK_BYTES)
    finally:
        os.close(fd)


def spin(stamp: Stamp, slot: int, cpu: int, window_s: float, parent: int) -> None:
    """The spinner's life: asleep while the last request is older than the window; else, holding its CPU's lock,
    busy until it is. Waiting for the lock it sleeps in the kernel (a spinner that woke every few milliseconds to
    try again measured worse: evidence/daemon-overhead/README.md, "Stop 49"). Returns when its parent is gone."""
    try:
        lock = os.open(lock_path(cpu), os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        lock = -1  # the lock cannot be had here (another user's file, say): spin without it
    while os.getppid() == parent:
        if not stamp.within(window_s):
            stamp.set_state(slot, ASLEEP)
            time.sleep(IDLE_CHECK_S)
            continue
        if lock >= 0:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                stamp.set_state(slot, WAITING)
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not stamp.within(window_s):
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    continue
        stamp.set_state(slot, SPINNING)
        try:
            while stamp.within(window_s) and os.getppid() == parent:
                for _ in range(SPIN_CHECK_EVERY):
                    pass
        finally:
            if lock >= 0:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _die_with_parent() -> None:
    """SIGKILL from the kernel when the daemon's thread that started this process ends (KeepWarm starts its spinners
    from the supervisor's loop, which runs for the daemon's life), even while blocked waiting for a CPU's lock."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpool.daemon.keep_warm_spinner", description="one spinner of `kvpool serve --keep-warm` (started by the daemon)")
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

"""At most N workers of one daemon compute at once, across processes: a System V semaphore of N units. The pool
creates it and writes its id to a file beside the socket; a worker takes a unit before it computes and gives it back
after. A waiter gets whichever unit frees first (the kernel hands it over), and every worker's operation is taken
with SEM_UNDO, so the kernel gives back a unit whose holder died holding it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import pathlib

IPC_PRIVATE = 0
IPC_CREAT = 0o1000
IPC_RMID = 0
SEM_UNDO = 0x1000
SEMAPHORES_TABLE = pathlib.Path("/proc/sysvipc/sem")  # key semid perms nsems uid gid cuid cgid otime ctime


class _Operation(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.semget.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
_libc.semop.argtypes = [ctypes.c_int, ctypes.POINTER(_Operation), ctypes.c_size_t]


class ComputeSemaphoreError(OSError):
    """The compute semaphore could not be created, read or used (the system's limits, a removed semaphore)."""


def _operate(semaphore_id: int, change: int, flags: int) -> None:
    operation = _Operation(0, change, flags)
    while _libc.semop(semaphore_id, ctypes.byref(operation), 1) != 0:
        code = ctypes.get_errno()
        if code != errno.EINTR:  # a signal: nothing was taken or given, ask again
            raise ComputeSemaphoreError(code, f"compute semaphore {semaphore_id}: semop({change:+d}): {os.strerror(code)}")


def _created_at(semaphore_id: int) -> str:
    """The semaphore's ctime as the kernel lists it ("" when the table cannot be read): with its id, what tells a
    semaphore this pool left from another that has the id since."""
    with contextlib.suppress(OSError):
        for line in SEMAPHORES_TABLE.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 10 and fields[1] == str(semaphore_id):
                return f"{fields[6]}:{fields[9]}"  # creator's uid, ctime
    return ""


def create(path: str, units: int) -> int:
    """A semaphore of `units` units, its id written to path; returns the id. One a daemon killed before it could
    destroy its own left behind (named by the file at path) is removed first (remove_left_behind)."""
    remove_left_behind(path)
    semaphore_id = _libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600)
    if semaphore_id < 0:
        code = ctypes.get_errno()
        raise ComputeSemaphoreError(code, f"cannot create the compute semaphore (semget: {os.strerror(code)}; see sysctl kernel.sem)")
    try:
        _operate(semaphore_id, units, 0)  # no SEM_UNDO: the units outlive this call
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(f"{semaphore_id} {_created_at(semaphore_id)}\n")
    except BaseException:
        destroy(path, semaphore_id)
        raise
    return semaphore_id


def destroy(path: str, semaphore_id: int) -> None:
    """Remove the semaphore create made (a worker waiting on it is answered EIDRM) and its file."""
    _libc.semctl(semaphore_id, 0, IPC_RMID)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _read(path: str) -> tuple[int, str]:
    fields = pathlib.Path(path).read_text().split()
    try:
        return int(fields[0]), fields[1] if len(fields) > 1 else ""
    except (IndexError, ValueError):
        raise ComputeSemaphoreError(errno.EINVAL, f"{path} names no compute semaphore") from None


def remove_left_behind(path: str) -> None:
    """Remove a semaphore a killed daemon left (its file still at path) if the kernel still lists it with the
    creator and ctime the file recorded (else the id is another's since, or the table cannot be read: left alone),
    and the file."""
    try:
        semaphore_id, created_at = _read(path)
    except FileNotFoundError:
        return
    except ComputeSemaphoreError:
        semaphore_id, created_at = -1, ""
    if semaphore_id >= 0 and created_at and _created_at(semaphore_id) == created_at:
        _libc.semctl(semaphore_id, 0, IPC_RMID)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ComputeSemaphore:
    """A worker's hold on one unit while it computes: `with semaphore: ...`."""

    def __init__(self, path: str) -> None:
        self._id, _ = _read(path)

    def __enter__(self) -> ComputeSemaphore:
        _operate(self._id, -1, SEM_UNDO)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _operate(self._id, 1, SEM_UNDO)

"""At most N workers of one daemon compute at once, across processes: a System V semaphore of N units. The pool
creates it and gives its id to every worker it spawns; a worker takes a unit before it computes and gives it back
after. A waiter gets whichever unit frees first (the kernel hands it over), and a worker's operations are taken
with SEM_UNDO, so the kernel gives back a unit whose holder died holding it.

The kernel keeps a semaphore until someone removes it, so three things do: the pool when it closes; every worker
that finds its supervisor gone (the supervisor was killed: the first to look removes it, workers.server.main); and,
where those could not (the workers killed with it), the next daemon on the socket. For that a record beside the
socket names the semaphore (its id, creator and ctime as /proc/sysvipc/sem lists them), flock'ed by the daemon
for as long as it lives: a record nobody holds names a semaphore left behind, removed if the kernel still lists
it as recorded (else the id is another's since, or the table cannot be read: left alone)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import pathlib
from dataclasses import dataclass

IPC_PRIVATE = 0
IPC_CREAT = 0o1000
IPC_RMID = 0
GETNCNT = 14  # how many wait for a unit
SEM_UNDO = 0x1000
MAX_UNITS = 32767  # SEMVMX: a semaphore's largest value
SEMAPHORES_TABLE = pathlib.Path("/proc/sysvipc/sem")  # key semid perms nsems uid gid cuid cgid otime ctime
GONE = (errno.EINVAL, errno.EIDRM)  # what the kernel answers about a removed semaphore


class _Operation(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.semget.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
_libc.semop.argtypes = [ctypes.c_int, ctypes.POINTER(_Operation), ctypes.c_size_t]
_libc.semctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]  # the commands used here take no fourth argument


class ComputeSemaphoreError(OSError):
    """The compute semaphore could not be created, used or removed (the system's limits, a removed semaphore,
    another daemon holding the record)."""


def _failed(what: str) -> ComputeSemaphoreError:
    code = ctypes.get_errno()
    return ComputeSemaphoreError(code, f"compute semaphore: {what}: {os.strerror(code)}")


def _operate(semaphore_id: int, change: int, flags: int) -> None:
    operation = _Operation(0, change, flags)
    while _libc.semop(semaphore_id, ctypes.byref(operation), 1) != 0:
        if ctypes.get_errno() != errno.EINTR:  # a signal: nothing was taken or given, ask again
            raise _failed(f"semop({change:+d}) on {semaphore_id}")


def remove(semaphore_id: int) -> None:
    """Remove the semaphore (waiters are answered EIDRM); one already gone is no error."""
    if _libc.semctl(semaphore_id, 0, IPC_RMID) != 0 and ctypes.get_errno() not in GONE:
        raise _failed(f"removing {semaphore_id}")


def waiting(semaphore_id: int) -> int:
    """How many wait for a unit now."""
    count = _libc.semctl(semaphore_id, 0, GETNCNT)
    if count < 0:
        raise _failed(f"GETNCNT of {semaphore_id}")
    return count


def _listed_as(semaphore_id: int) -> str:
    """The semaphore's creator and ctime as the kernel lists them ("" when not listed or the table cannot be read)."""
    with contextlib.suppress(OSError):
        for line in SEMAPHORES_TABLE.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 10 and fields[1] == str(semaphore_id):
                return f"{fields[6]}:{fields[9]}"
    return ""


def _hold_record(path: str) -> int:
    """Open the record at path (created if missing) and flock it; ComputeSemaphoreError when a live daemon holds it.
    A record unlinked between the open and the lock (its holder closing) is opened again."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise ComputeSemaphoreError(errno.EBUSY, f"another daemon holds {path} (its compute semaphore's record): is one starting on this socket?") from None
        except BaseException:
            os.close(descriptor)
            raise
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                return descriptor
        os.close(descriptor)


def _remove_recorded(descriptor: int) -> None:
    """Remove the semaphore a held record names, if the kernel still lists it as recorded."""
    fields = os.pread(descriptor, 256, 0).split()
    with contextlib.suppress(ValueError, IndexError):
        semaphore_id, listed_as = int(fields[0]), fields[1].decode()
        if listed_as and _listed_as(semaphore_id) == listed_as:
            remove(semaphore_id)


@dataclass
class Created:
    """A semaphore the pool created, and its record (held until destroy)."""

    id: int
    path: str
    descriptor: int


def create(path: str, units: int) -> Created:
    """A semaphore of `units` units, recorded at path (a semaphore a record nobody holds names is removed first)."""
    if not 1 <= units <= MAX_UNITS:
        raise ComputeSemaphoreError(errno.EINVAL, f"a compute semaphore has 1 to {MAX_UNITS} units, not {units}")
    descriptor = _hold_record(path)
    try:
        _remove_recorded(descriptor)
        semaphore_id = _libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600)
        if semaphore_id < 0:
            raise _failed("semget (the system's limits: sysctl kernel.sem)")
        try:
            _operate(semaphore_id, units, 0)  # no SEM_UNDO: the units outlive this call
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"{semaphore_id} {_listed_as(semaphore_id)}\n".encode(), 0)
        except BaseException:
            remove(semaphore_id)
            raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(descriptor)
        raise
    return Created(semaphore_id, path, descriptor)


def destroy(created: Created) -> None:
    """Remove the semaphore and its record (still this daemon's: it holds it); a second call does nothing."""
    if created.descriptor < 0:
        return
    try:
        remove(created.id)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(created.path)
        os.close(created.descriptor)
        created.descriptor = -1


def clear_left_behind(path: str) -> None:
    """What a daemon that needs no semaphore does with the record at path: remove what a dead daemon left (nothing
    when there is no record or a live daemon holds it)."""
    if not os.path.exists(path):
        return
    with contextlib.suppress(ComputeSemaphoreError):
        descriptor = _hold_record(path)
        try:
            _remove_recorded(descriptor)
            os.unlink(path)
        finally:
            os.close(descriptor)


class ComputeSemaphore:
    """A worker's hold on one unit while it computes: `with semaphore: ...`."""

    def __init__(self, semaphore_id: int) -> None:
        self.id = semaphore_id

    def __enter__(self) -> ComputeSemaphore:
        _operate(self.id, -1, SEM_UNDO)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            _operate(self.id, 1, SEM_UNDO)
        except ComputeSemaphoreError as error:
            if error.errno not in GONE:  # removed while held (the daemon is gone): nothing to give back
                raise

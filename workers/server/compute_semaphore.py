"""At most N workers of one daemon compute at once, across processes: a System V semaphore of N units. The pool
creates it and gives its id to every worker it spawns; a worker takes a unit before it computes and gives it back
after. A waiter gets whichever unit frees first (the kernel hands it over), and a worker's operations are taken
with SEM_UNDO, so the kernel gives back a unit whose holder died holding it.

The kernel keeps a semaphore until someone removes it, so four things do: the pool when it closes; the lifeline
when it gives up waiting for the pool (kvpool.daemon.lifeline: remove_created); every worker that finds its
supervisor gone (the supervisor was killed: the first to look removes it, workers.server.main); and, where none of
those could (the workers killed with it), the next daemon started on the socket. For that each daemon records its
semaphore beside the socket (`<prefix>.<pid>`: its id, creator and ctime as /proc/sysvipc/sem lists them) and
holds the record flock'ed for as long as it lives; a record nobody holds names a semaphore left behind, removed if
the kernel still lists it as recorded (else the id is another's since, or the table cannot be read: left alone).
One record per daemon: a daemon started while the last on the socket still stops is not kept waiting."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import glob
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
    """The compute semaphore could not be created, used or removed (the system's limits, a removed semaphore)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _failed(what: str) -> ComputeSemaphoreError:
    code = ctypes.get_errno()
    return ComputeSemaphoreError(code, f"compute semaphore: {what}: {os.strerror(code)}")


def _operate(semaphore_id: int, operation: _Operation) -> None:
    while _libc.semop(semaphore_id, operation, 1) != 0:
        if ctypes.get_errno() != errno.EINTR:  # a signal: nothing was taken or given, ask again
            raise _failed(f"semop({operation.sem_op:+d}) on {semaphore_id}")


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


def _hold_record(path: str) -> int | None:
    """Open the record at path (created if missing) and flock it; None when a live daemon holds it. A record
    unlinked between the open and the lock (its holder letting go) is opened again."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return None
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


def clear_left_behind(prefix: str) -> None:
    """Remove what dead daemons left under `prefix` (the records nobody holds, and the semaphores they name); a
    live daemon's record is left alone. Every daemon does it as it starts, with a bound or not."""
    for path in glob.glob(glob.escape(prefix) + ".*"):
        descriptor = _hold_record(path)
        if descriptor is None:
            continue
        try:
            _remove_recorded(descriptor)
            os.unlink(path)
        finally:
            os.close(descriptor)


@dataclass
class Created:
    """A semaphore this process created, and its record (held until destroy)."""

    id: int
    path: str
    descriptor: int


_created: dict[int, Created] = {}  # what this process created and has not destroyed (remove_created)


def create(prefix: str, units: int) -> Created:
    """A semaphore of `units` units, recorded at `<prefix>.<pid>`, after clear_left_behind(prefix)."""
    if not 1 <= units <= MAX_UNITS:
        raise ComputeSemaphoreError(errno.EINVAL, f"a compute semaphore has 1 to {MAX_UNITS} units, not {units}")
    clear_left_behind(prefix)
    path = f"{prefix}.{os.getpid()}"
    descriptor = _hold_record(path)
    if descriptor is None:  # the pid is this process's: nobody else can hold it
        raise ComputeSemaphoreError(errno.EBUSY, f"{path} is held by another process")
    try:
        semaphore_id = _libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600)
        if semaphore_id < 0:
            raise _failed("semget (the system's limits: sysctl kernel.sem)")
        try:
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"{semaphore_id} {_listed_as(semaphore_id)}\n".encode(), 0)  # recorded first: a kill from here leaks nothing
            _operate(semaphore_id, _Operation(0, units, 0))  # no SEM_UNDO: the units outlive this call
        except BaseException:
            remove(semaphore_id)
            raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(descriptor)
        raise
    _created[semaphore_id] = created = Created(semaphore_id, path, descriptor)
    return created


def destroy(created: Created) -> None:
    """Remove the semaphore and its record (this process's: it holds it); a second call does nothing."""
    if created.descriptor < 0:
        return
    _created.pop(created.id, None)
    try:
        remove(created.id)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(created.path)
        os.close(created.descriptor)
        created.descriptor = -1


def remove_created() -> None:
    """Remove every semaphore this process created and has not destroyed, as a process about to exit without
    its pool's close does (their records stay: the next daemon on the socket finds them naming nothing)."""
    for semaphore_id in list(_created):
        with contextlib.suppress(OSError):
            remove(semaphore_id)


class ComputeSemaphore:
    """A worker's hold on one unit while it computes: `with semaphore: ...` (its two operations built once: the
    decode step takes and gives back a unit)."""

    def __init__(self, semaphore_id: int) -> None:
        self.id = semaphore_id
        self._take = _Operation(0, -1, SEM_UNDO)
        self._give = _Operation(0, 1, SEM_UNDO)

    def __enter__(self) -> ComputeSemaphore:
        _operate(self.id, self._take)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            _operate(self.id, self._give)
        except ComputeSemaphoreError as error:
            if error.errno not in GONE:  # removed while held (the daemon is gone): nothing to give back
                raise

"""A daemon never outlives the program that started it.

The launcher (kvpool.launcher) keeps the write end of a pipe whose read end the daemon inherits
(`kvpool serve --lifeline-fd N`). The kernel closes the write end when the launching process dies, by
any signal, SIGKILL included, so the daemon reads end-of-file. It then stops at once as on SIGINT (no
drain: sessions dropped, workers stopped, socket removed) and, should that not finish within `grace_s`, kills its
workers and exits at once. PR_SET_PDEATHSIG is not used: it fires when the *thread* that started the
child exits, which is not the same as the launching program ending.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import threading
import time
from multiprocessing import resource_tracker

import psutil

from workers.server import compute_semaphore

GRACE_S = 3.0

log = logging.getLogger("kvpool.serve")


def _kill_children() -> None:
    """Kill the workers, but not multiprocessing's resource tracker: once this process has exited, the
    tracker unlinks the shared-memory segments it still holds, which nothing else would."""
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    children = [child for child in psutil.Process().children(recursive=True) if child.pid != tracker]
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=1.0)


def watch_lifeline(fd: int, *, socket_path: pathlib.Path, grace_s: float = GRACE_S) -> threading.Thread:
    """Watch `fd` from a daemon thread; on end-of-file stop this process (see the module's text)."""
    os.set_inheritable(fd, False)  # the workers must not hold the lifeline open

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 4096):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        log.warning("the program that started this daemon is gone: shutting down")
        os.kill(os.getpid(), signal.SIGINT)  # SIGTERM would drain: nobody is left to come back
        time.sleep(grace_s)
        log.warning("not stopped after %g s: killing the workers and exiting", grace_s)
        compute_semaphore.remove_created()  # which the kernel would keep, and the pool's close will not remove now
        _kill_children()
        with contextlib.suppress(OSError):
            socket_path.unlink()
        os._exit(1)

    thread = threading.Thread(target=watch, name="kvpool-lifeline", daemon=True)
    thread.start()
    return thread

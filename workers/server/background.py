"""Work no caller waits for, run at a lower CPU priority: a park's save behind its answer (Park.wait false,
kvpool.daemon.warm), which would otherwise take a core from the requests other processes are answering at that
moment. A route parks on all its daemons at once; on a machine with fewer cores than daemons the first daemon's
save began while the last had not yet answered, and the route's park waited for it (evidence/warm-tier/README.md,
"Stop 45": the median park of 3 daemons on 2 cores 2.7 ms as the save ran, 1.8 ms with it at nice +10).

The work runs in one thread of the worker's own whose nice value is BACKGROUND_NICE above the worker's (Linux:
a nice value is a thread's; a thread may lower its priority but not raise it again, hence a thread kept for it). The
worker's loop waits for the work as it would for its own call: nothing else uses the context meanwhile, and the
worker serves nothing else, as before. The lower priority is a preference: where it cannot be set the work runs as it
would have, and under full load such work gets a smaller share of a core (at +10, about a tenth against one busy
process at the worker's priority), so what waits for it (the session's next request) waits longer."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

BACKGROUND_NICE = 10
_MOST_NICE = 19

T = TypeVar("T")


def lower_this_thread(by: int = BACKGROUND_NICE) -> None:
    """The calling thread's nice value raised by `by` (at most 19); an OSError is left unraised."""
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(_MOST_NICE, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except OSError:
        pass


def in_this_thread(work: Callable[..., T], *args: object) -> T:
    """Background.run's counterpart for work a caller waits for: the call itself."""
    return work(*args)


class Background:
    """One thread at a lower priority, started at its first use; run() waits for the work's result (or raises its error)."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, work: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-background", initializer=lower_this_thread)
        return self._executor.submit(work, *args).result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

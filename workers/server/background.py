"""Work no caller waits for, run at a lower CPU priority: the save of a park answered before it (Park.wait false,
kvpool.daemon.warm), of a park for --park-after and of a copy written behind for --persist-after (kvpool.daemon.
admission.parking), which would otherwise take a core from the requests being answered at that moment. A route
parks on all its daemons at once; on a machine with fewer cores than daemons the first daemon's save began while
the last had not yet answered, and the route's park waited for it (evidence/warm-tier/README.md, "Stop 45": the
median park of 3 daemons on 2 cores 2.7 ms before, 1.3-2.2 ms in five runs with the save at nice +10).

The work runs in one thread of the worker's own, started with the worker, whose nice value is --background-nice
(BACKGROUND_NICE by default; 0: no thread, the work runs in the loop's own) above the worker's (Linux: a nice value
is a thread's; without CAP_SYS_NICE a thread may lower its priority but not raise it again, hence a thread kept for
it). The worker's loop waits for the work as it would for its own call: nothing
else uses the context meanwhile, and the worker serves nothing else, as before. A nice value ranks threads only
against those of the same scheduling group (the same autogroup, i.e. session, or CPU cgroup): it helps where a
route's daemons share cores and a group, as daemons started together do; daemons on separate hosts, or in separate
services or containers, gain nothing from it and keep its cost. That cost: under full load such work gets a smaller
share of a core (at +10, about a tenth against one busy thread at the worker's priority), and what waits for it
waits longer - the session's next request, a drain (it waits for the sessions' requests in flight), an admission or
a restore that wants this worker. The lower priority is a preference: where it cannot be set the work runs as it
would have."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

BACKGROUND_NICE = 10
MOST_NICE = 19  # the largest nice value Linux gives

T = TypeVar("T")


def lower_this_thread(by: int = BACKGROUND_NICE) -> None:
    """The calling thread's nice value raised by `by` (at most 19); an OSError is left unraised."""
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(MOST_NICE, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except OSError:
        pass


def in_this_thread(work: Callable[..., T], *args: object) -> T:
    """Background.run's counterpart for work a caller waits for: the call itself."""
    return work(*args)


class Background:
    """One thread `by` nice values lower (--background-nice), started here (its stack and malloc arena then exist
    before the worker reports ready, not after its first save); run() waits for the work's result (or raises its error)."""

    def __init__(self, by: int = BACKGROUND_NICE) -> None:
        self._by = by
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._start()

    def run(self, work: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            self._start()
        assert self._executor is not None
        return self._executor.submit(work, *args).result()

    def _start(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-background", initializer=lower_this_thread, initargs=(self._by,))
        self._executor.submit(int).result()  # the thread started and lowered

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

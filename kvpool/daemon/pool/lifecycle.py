"""What happens to a worker between sessions: its context freed, a lost or drifted worker replaced, and
the admissions waiting for room woken. Blocking work (starting a replacement, reading memory) runs in
threads; the books change on the event loop only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from kvpool.daemon.books.books import Books
from kvpool.daemon.books.sessions import Session
from kvpool.daemon.metrics import Metrics
from kvpool.daemon.pool.handle import WorkerFailed, WorkerLost
from kvpool.daemon.pool.pool import WorkerPool
from kvpool.wire.errors import RequestFailed
from kvpool.wire.protocol import ErrorCode, MissReason

LOST = "the worker serving this session was lost"
Refusal = Callable[[WorkerFailed], RequestFailed]

log = logging.getLogger("kvpool.serve")


class WorkerLifecycle:
    def __init__(self, books: Books, pool: WorkerPool, metrics: Metrics, *, threads: int) -> None:
        self.books = books
        self.pool = pool
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvpool-call")
        self._capacity_freed = asyncio.Condition()
        self._background: set[asyncio.Task] = set()

    async def in_thread(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def spawn(self, coroutine) -> asyncio.Task:
        """Run in the background; a failure is logged, never lost."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # ---- capacity --------------------------------------------------------------------------------

    async def notify_capacity(self) -> None:
        async with self._capacity_freed:
            self._capacity_freed.notify_all()

    async def wait_for_capacity(self, timeout_s: float) -> None:
        """Until room may have been freed (a session went idle or ended, a worker came back) or the timeout."""
        async with self._capacity_freed:
            try:
                await asyncio.wait_for(self._capacity_freed.wait(), timeout_s)
            except TimeoutError:
                pass

    # ---- workers in transit ----------------------------------------------------------------------

    async def free(self, worker: str) -> None:
        """Free an in-transit worker's context and hand it back to the books (or replace it if it died)."""
        try:
            await self.pool.get(worker).close_context()
        except WorkerLost:
            await self.replace(worker)
            return
        self.books.give_back(worker)
        await self.notify_capacity()

    async def replace(self, worker: str) -> None:
        """Stop an in-transit worker and start a fresh, free one in its place."""
        self.metrics.count("worker_restarts")
        try:
            fresh = await self.in_thread(self.pool.start_replacement, worker)
        except BaseException:
            self.pool.swap(worker, None)
            self.books.remove_worker(worker)
            raise
        # The pool and the books change together, on the loop: a status request never sees one without the other.
        self.pool.swap(worker, fresh)
        self.books.remove_worker(worker)
        self.books.add_worker(fresh.name)
        await self.notify_capacity()

    async def drop(self, session: Session, reason: MissReason, *, keep: bool = False) -> None:
        """End a live session now: the books at once (a parked one's blob too), then its worker's context.
        `keep` (the caller holds the session's lock: a release, a newer epoch): a hot session's worker in
        process mode keeps the context as its spare first (workers.server.commands.CloseContext.keep: zeroed
        before another session's context is opened in it), then the books free the worker with that spare, the
        charge moving to it, so the next admission of its n_ctx there creates no context. A worker that cannot
        keep it (lost, refused) ends the session as without `keep`."""
        worker_name = session.worker_name
        if keep and session.hot and not self.pool.batched and self.books.session_of(worker_name) is session:
            session.in_flight += 1  # busy meanwhile: no eviction takes it (a newer epoch's fence counts no request)
            try:
                await self.pool.get(worker_name).close_context(keep=True)
                kept = True
            except (WorkerLost, WorkerFailed):
                kept = False
            finally:
                session.in_flight -= 1
            if kept and self.books.session_of(worker_name) is session:
                self.books.forget(session, reason, kept=True)
                self.metrics.count("spares_kept")
                await self.notify_capacity()
                return
            if kept or self.books.table.get(session.session_id) is not session:
                return  # it ended meanwhile another way, which saw to its worker
        worker = self.books.forget(session, reason)
        if worker is not None:
            await self.free(worker)
        else:
            await self.notify_capacity()

    def lost(self, session: Session) -> None:
        """The session's worker died or stalled: the session ends (worker_lost) and the worker is replaced."""
        worker = self.books.forget(session, MissReason.WORKER_LOST)
        self.metrics.count_error(ErrorCode.WORKER_LOST)
        self.spawn(self.replace(worker))

    @contextlib.asynccontextmanager
    async def worker_call(self, session: Session, *, lost: str = LOST, refused: str | Refusal) -> AsyncIterator[None]:
        """`async with lifecycle.worker_call(session, refused=...):` around calls to the session's worker: the
        error reply of a worker failure. Lost: the session ends (lost()) and the reply is worker_lost,
        "{lost}: why". Refused: `refused(failure)` is raised, or, for a text, internal "{refused}: why" with
        the session's length."""
        try:
            yield
        except WorkerLost as error:
            self.lost(session)
            raise RequestFailed(ErrorCode.WORKER_LOST, f"{lost}: {error}") from None
        except WorkerFailed as failure:
            if isinstance(refused, str):
                raise RequestFailed(ErrorCode.INTERNAL, f"{refused}: {failure}", length=session.length) from None
            raise refused(failure) from None

    async def replace_dead_free(self) -> None:
        """A free worker that died (nobody was using it) is replaced before anyone is lent it."""
        for worker in self.books.take_unusable(self.pool.usable):
            await self.replace(worker)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

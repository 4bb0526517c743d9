"""One worker process as the supervisor sees it: spawned with its segment and pipes, ready or not, exited
or not, its memory readings, one command and its reply over the pipe, and its stop.

One call at a time per worker (its pipe carries one command and then its one reply); replies are awaited
on the event loop (no thread hop). A call not answered within the request timeout kills the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import secrets
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import msgspec
import psutil

from kvpool.daemon.pool.errors import WorkerLost, WorkerStartFailed
from kvpool.daemon.pool.segment import WorkerSegment
from kvpool.daemon.pool.spec import PoolSpec
from workers.server.commands import AnyCommand, AnyWorkerReply, CancelDirect, Exit, Failed, Ready
from workers.server.entry import worker_entry
from workers.server.pipe import receive_reply, send_command
from workers.server.readings import anonymous_bytes
from workers.server.spec import WorkerSpec


class WorkerProcess:
    """A spawned worker and what it owns: its process, its pipes and its shared-memory segment (`shared`).
    `lost` is set once the worker can no longer be trusted with a call; it never clears."""

    def __init__(self, name: str, spec: PoolSpec, index: int = 0) -> None:
        self.name = name
        self.direct_address = f"kvpool-{os.getpid()}-{name}-{secrets.token_hex(6)}" if spec.direct and not spec.worker.seqs_per_worker else ""
        self.request_timeout_s = spec.request_timeout_s
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AnyWorkerReply)
        self._async_call_lock = asyncio.Lock()
        self._waiting: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None  # the call in flight: its loop and wake-up
        regions = spec.worker.segment
        self.segment_bytes = regions.total_bytes
        self.shared = WorkerSegment(regions)
        self.input_offset = regions.input_offset
        self.output_offset = regions.output_offset
        self.input_bytes = regions.input_bytes
        self.output_bytes = regions.output_bytes
        self.direct = self.shared.direct
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe(duplex=True)
        self._connection: Connection = parent_end
        cancel_end, child_cancel_end = context.Pipe(duplex=True)
        self._cancel_connection: Connection = cancel_end
        worker_spec = spec.worker_spec(shm_name=self.segment.name, parent_pid=os.getpid(), direct_address=self.direct_address, worker_index=index)
        self.process = self._start(context, worker_spec, child_end, child_cancel_end)
        self.ready: Ready | None = None
        self._ps: psutil.Process | None = None
        self.baseline_uss = 0
        self.lost = False

    def _start(self, context, worker_spec: WorkerSpec, child_end: Connection, child_cancel_end: Connection):
        """The worker, started on the child's ends of its pipes (which it then owns). The one place a worker
        runs: a spawned process serving workers.server.main.worker_main (through workers.server.entry, so that
        the supervisor never imports llama.cpp)."""
        process = context.Process(target=worker_entry, args=(child_end, worker_spec, child_cancel_end), name=self.name, daemon=True)
        process.start()
        child_end.close()  # so a dead worker reads as EOF on our end
        child_cancel_end.close()
        return process

    @property
    def segment(self) -> shared_memory.SharedMemory | None:
        """The shared memory itself; None once the worker has stopped."""
        return self.shared.memory

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    @property
    def exited(self) -> bool:
        """The process has ended. Neither multiprocessing's is_alive() (True when the exit status was
        collected elsewhere) nor the sentinel pipe (open while another process holds its write end) is
        enough alone: a zombie read from /proc counts too (seen: a SIGKILLed free worker lent out)."""
        if self.process.exitcode is not None or multiprocessing.connection.wait([self.process.sentinel], timeout=0):
            return True
        try:
            if self._ps is None:  # made once: each new psutil.Process reads /proc for the pid's start time (asked on every admission)
                self._ps = psutil.Process(self.pid)
            return self._ps.status() == psutil.STATUS_ZOMBIE  # a zombie's pid is not reused: the object names this worker
        except psutil.NoSuchProcess:
            return True

    def wait_ready(self, timeout_s: float) -> Ready:
        if not self._connection.poll(timeout_s):
            raise WorkerStartFailed(f"{self.name} did not report ready within {timeout_s:.0f} s")
        try:
            reply = self._decoder.decode(self._connection.recv_bytes())
        except EOFError as error:
            raise WorkerStartFailed(f"{self.name} exited during start (exit code {self.process.exitcode})") from error
        if isinstance(reply, Failed):
            raise WorkerStartFailed(f"{self.name}: {reply.message}")
        assert isinstance(reply, Ready)
        self.ready = reply
        self.baseline_uss = self.measure_uss()
        return reply

    async def call(self, command: AnyCommand) -> AnyWorkerReply:
        """Send one command and await its reply on the event loop. Raises WorkerLost if the process is gone
        or does not answer within the request timeout (it is then killed: a stalled worker never comes
        back into use). If the awaiting task is cancelled the pipe may hold an unread reply, so the worker
        is marked lost (the supervisor replaces lost workers)."""
        async with self._async_call_lock:
            if self.lost:
                raise WorkerLost(f"{self.name} is lost")
            loop = asyncio.get_running_loop()
            descriptor = self._connection.fileno()
            readable = loop.create_future()
            try:
                send_command(self._connection, self._encoder, command)
                self._waiting = (loop, readable)
                loop.add_reader(descriptor, lambda: readable.done() or readable.set_result(None))
                timer = loop.call_later(self.request_timeout_s, lambda: readable.done() or readable.set_exception(TimeoutError()))
                try:
                    await readable
                finally:
                    self._waiting = None
                    timer.cancel()
                    loop.remove_reader(descriptor)
                reply = receive_reply(self._connection, self._decoder)
            except TimeoutError:
                self.lost = True
                self.process.kill()
                raise WorkerLost(
                    f"{self.name} (pid {self.pid}) did not answer {type(command).__name__} within "
                    f"{self.request_timeout_s:g} s and was killed"
                ) from None
            except (EOFError, OSError) as error:
                self.lost = True
                raise WorkerLost(f"{self.name} (pid {self.pid}) died: exit code {self.process.exitcode}") from error
            except asyncio.CancelledError:
                self.lost = True
                raise
            return reply

    def send_cancel(self, command: CancelDirect) -> None:
        """Hand `command` to the worker's cancel thread, over its own pipe (no reply awaited)."""
        if self.lost or self.segment is None:
            return
        try:
            self._cancel_connection.send_bytes(self._encoder.encode(command))
        except OSError:
            pass  # the worker is gone: nothing to cancel

    def measure_uss(self) -> int:
        try:
            return psutil.Process(self.pid).memory_full_info().uss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return 0

    def measure_anonymous(self) -> int:
        """The worker's anonymous memory (what its contexts allocate). Unlike USS it leaves out the mmap'd
        weights, whose pages count as private while no other process maps them and come and go with the
        page cache (seen: +-20 MiB between two readings). USS where it is missing."""
        return anonymous_bytes(self.pid) or self.measure_uss()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit, then terminate and kill as needed; release the segment. Idempotent."""
        if self.process.is_alive() and not self.lost:
            try:
                self._connection.send_bytes(self._encoder.encode(Exit()))
            except (OSError, ValueError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
        self.lost = True
        self._connection.close()
        self._cancel_connection.close()
        waiting = self._waiting
        if waiting is not None:
            # A call in flight (stop may run in a thread: a batched process is stopped when any of its slots
            # is replaced) would wait on a closed pipe forever: it ends as the worker's end of the pipe would.
            loop, readable = waiting
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(lambda: readable.done() or readable.set_exception(EOFError("the worker was stopped")))
        self.shared.release()

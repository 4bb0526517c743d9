"""The worker pool: spawned, named worker processes, each with its pipe and shared-memory segment.

The pool owns processes and segments and nothing else: which session a worker serves is the
supervisor's business. The supervisor calls a worker from its event loop (call_async: the reply is
awaited on the pipe's file descriptor, no thread hop); one call at a time per worker, since its pipe
carries one command and then its one reply.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import psutil

from kvpool.integrity import require
from kvpool.segments import SegmentLayout
from workers.commands import (
    ABORT_FLAG_OFFSET,
    AnyCommand,
    AnyWorkerReply,
    Appended,
    Exit,
    Failed,
    Ready,
)
from workers.process import WorkerSpec, worker_main


class WorkerLost(Exception):
    """The worker process died or stopped answering; its context is gone."""


class WorkerStartFailed(Exception):
    pass


@dataclass(frozen=True, slots=True)
class PoolSpec:
    shard_path: str
    size: int
    segment: SegmentLayout
    n_threads: int
    flash_attn: bool
    ready_timeout_s: float
    request_timeout_s: float  # a call not answered by then: the worker is killed and counts as lost
    n_gpu_layers: int = 0
    verbose: bool = False


class WorkerHandle:
    """The supervisor's side of one worker process."""

    def __init__(self, name: str, spec: PoolSpec) -> None:
        self.name = name
        self.request_timeout_s = spec.request_timeout_s
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AnyWorkerReply)
        self._async_call_lock = asyncio.Lock()
        layout = spec.segment
        self.segment_bytes = layout.total_bytes
        self.segment = shared_memory.SharedMemory(create=True, size=layout.total_bytes)
        self.input_offset = layout.input_offset
        self.output_offset = layout.output_offset
        self._abort_flag = ctypes.c_int32.from_buffer(self.segment.buf, ABORT_FLAG_OFFSET)
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe(duplex=True)
        self._connection: Connection = parent_end
        worker_spec = WorkerSpec(
            shard_path=spec.shard_path,
            shm_name=self.segment.name,
            input_bytes=layout.input_bytes,
            output_bytes=layout.output_bytes,
            n_threads=spec.n_threads,
            flash_attn=spec.flash_attn,
            parent_pid=os.getpid(),
            n_gpu_layers=spec.n_gpu_layers,
            verbose=spec.verbose,
        )
        self.process = context.Process(target=worker_main, args=(child_end, worker_spec), name=name, daemon=True)
        self.process.start()
        child_end.close()  # so a dead worker reads as EOF on our end
        self.ready: Ready | None = None
        self.baseline_uss = 0
        self.lost = False

    @property
    def pid(self) -> int:
        return self.process.pid or 0

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

    async def call_async(self, command: AnyCommand) -> AnyWorkerReply:
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
                self._connection.send_bytes(self._encoder.encode(command))
                loop.add_reader(descriptor, lambda: readable.done() or readable.set_result(None))
                timer = loop.call_later(self.request_timeout_s, lambda: readable.done() or readable.set_exception(TimeoutError()))
                try:
                    await readable
                finally:
                    timer.cancel()
                    loop.remove_reader(descriptor)
                payload = self._connection.recv_bytes()
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
            return self._decoder.decode(payload)

    def set_abort(self, value: bool) -> None:
        self._abort_flag.value = 1 if value else 0

    def write_input(self, rows: np.ndarray) -> None:
        view = np.frombuffer(self.segment.buf, rows.dtype, rows.size, self.input_offset)
        view[:] = rows.reshape(-1)

    def read_output(self, appended: Appended) -> bytes:
        if appended.inline:
            return appended.inline
        start = self.output_offset
        return bytes(self.segment.buf[start : start + appended.rows * appended.width * 4])

    def measure_uss(self) -> int:
        try:
            return psutil.Process(self.pid).memory_full_info().uss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return 0

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
        self._release_segment()

    def _release_segment(self) -> None:
        if self.segment is None:
            return
        del self._abort_flag
        try:
            self.segment.close()
        except BufferError:
            pass  # a reader still holds a view; the mapping goes with the process
        try:
            self.segment.unlink()
        except FileNotFoundError:
            pass
        self.segment = None  # type: ignore[assignment]


class WorkerPool:
    """Starts `size` workers, lends them out, takes them back, replaces lost ones.

    Every worker is either free or taken, never both (check_integrity). The supervisor binds taken
    workers to sessions; a taken worker that is bound to none is in transit (being freed, calibrated
    or replaced) and goes back through give_back() or replace().
    """

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._counter = 0
        self._workers: dict[str, WorkerHandle] = {}
        self._free: list[str] = []
        self._taken: set[str] = set()
        self._lock = threading.Lock()

    def start(self) -> Ready:
        """Spawn every worker in parallel and wait for all to be ready; on failure stop them all."""
        handles = [self._spawn() for _ in range(self.spec.size)]
        try:
            with ThreadPoolExecutor(max_workers=len(handles)) as executor:
                readies = list(executor.map(lambda h: h.wait_ready(self.spec.ready_timeout_s), handles))
        except BaseException:
            for handle in handles:
                handle.stop(timeout_s=1.0)
            raise
        with self._lock:
            for handle in handles:
                self._workers[handle.name] = handle
                self._free.append(handle.name)
        return readies[0]

    def _next_name(self) -> str:
        """Unique for the pool's life, also when replacements start in several threads at once."""
        with self._lock:
            self._counter += 1
            return f"kvpool-worker-{self._counter}"

    def _spawn(self) -> WorkerHandle:
        return WorkerHandle(self._next_name(), self.spec)

    def workers(self) -> list[WorkerHandle]:
        with self._lock:
            return list(self._workers.values())

    def get(self, name: str) -> WorkerHandle:
        return self._workers[name]

    def taken_names(self) -> set[str]:
        with self._lock:
            return set(self._taken)

    @staticmethod
    def _usable(handle: WorkerHandle) -> bool:
        return not handle.lost and handle.process.is_alive()

    @property
    def free_count(self) -> int:
        """Free workers that can be lent now (a dead free worker is no capacity: it waits for reap_dead)."""
        with self._lock:
            return sum(1 for name in self._free if self._usable(self._workers[name]))

    @property
    def has_dead_free(self) -> bool:
        with self._lock:
            return any(not self._usable(self._workers[name]) for name in self._free)

    @property
    def segment_bytes(self) -> int:
        """Shared memory held by the workers' segments (fixed per worker; outside the session budget)."""
        with self._lock:
            return sum(handle.segment_bytes for handle in self._workers.values())

    def take_free(self) -> WorkerHandle | None:
        """A live free worker, now taken; None if there is none (dead free workers wait for reap_dead)."""
        with self._lock:
            for name in reversed(self._free):
                handle = self._workers[name]
                if self._usable(handle):
                    self._free.remove(name)
                    self._taken.add(name)
                    return handle
            return None

    def take_specific(self, handle: WorkerHandle) -> WorkerHandle | None:
        """Take this worker if it is free; None if it is not."""
        with self._lock:
            if handle.name not in self._free:
                return None
            self._free.remove(handle.name)
            self._taken.add(handle.name)
            return handle

    def reap_dead(self) -> list[WorkerHandle]:
        """Take the free workers whose process has died (the caller replaces them)."""
        with self._lock:
            dead = [self._workers[name] for name in self._free if not self._usable(self._workers[name])]
            for handle in dead:
                self._free.remove(handle.name)
                self._taken.add(handle.name)
            return dead

    def give_back(self, handle: WorkerHandle) -> None:
        with self._lock:
            if handle.name in self._taken:
                self._taken.remove(handle.name)
                self._free.append(handle.name)

    def replace(self, handle: WorkerHandle) -> WorkerHandle:
        """Stop a taken worker (lost, or drifted in memory) and start a fresh, free one in its place. Blocking."""
        handle.stop(timeout_s=1.0)
        with self._lock:
            require(handle.name not in self._free, "replace() takes a taken worker")
            self._workers.pop(handle.name, None)
            self._taken.discard(handle.name)
        fresh = self._spawn()
        try:
            fresh.wait_ready(self.spec.ready_timeout_s)
        except BaseException:
            fresh.stop(timeout_s=1.0)
            raise
        with self._lock:
            self._workers[fresh.name] = fresh
            self._free.append(fresh.name)
        return fresh

    def check_integrity(self) -> None:
        with self._lock:
            free = set(self._free)
            require(len(free) == len(self._free), "a worker is free twice")
            require(not free & self._taken, f"workers both free and taken: {sorted(free & self._taken)}")
            require(
                free | self._taken == set(self._workers),
                f"free {sorted(free)} + taken {sorted(self._taken)} != all {sorted(self._workers)}",
            )
            expected = self.spec.segment.total_bytes
            wrong = sorted(h.name for h in self._workers.values() if h.segment_bytes != expected)
            require(not wrong, f"workers whose segment is not {expected} bytes: {wrong}")

    def close(self) -> None:
        with self._lock:
            handles = list(self._workers.values())
            self._workers.clear()
            self._free.clear()
            self._taken.clear()
        for handle in reversed(handles):
            handle.stop()

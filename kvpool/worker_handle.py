"""The supervisor's side of one worker process: a typed facade over its pipe and shared-memory segment.

One call at a time per worker (its pipe carries one command and then its one reply); replies are awaited
on the event loop (no thread hop). A call not answered within the request timeout kills the worker.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import secrets
import dataclasses
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import psutil

from kvpool.segments import SegmentLayout
from kvpool.worker_controls import DirectControls
from workers.commands import (
    ABORT_FLAG_OFFSET,
    AnyCommand,
    AnyWorkerReply,
    Appended,
    BindChannel,
    CancelDirect,
    ChannelState,
    CloseContext,
    Closed,
    Exit,
    Failed,
    Opened,
    OpenContext,
    Ready,
    Restored,
    RestoreState,
    RevokeChannel,
    RunAppend,
    Saved,
    SaveState,
    Truncated,
    TruncateContext,
)
from workers.process import WorkerSpec, anonymous_bytes, worker_main
from workers.sampling import Sampling


class WorkerLost(Exception):
    """The worker process died or stopped answering; its context is gone."""


class WorkerStartFailed(Exception):
    pass


class WorkerFailed(Exception):
    """The worker refused a command; `code` names why (an ErrorCode value where one applies) and `length`
    is its context's length after the refusal."""

    def __init__(self, code: str, message: str, length: int) -> None:
        super().__init__(message)
        self.code = code
        self.length = length


@dataclass(frozen=True, slots=True)
class WorkerOutput:
    length: int
    rows: int
    width: int
    data: bytes  # float32 little-endian [rows, width]
    token: int = -1  # with sampling: the token picked on the last shard
    top_ids: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[float] = dataclasses.field(default_factory=list)


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
    direct: bool = True  # each worker also listens on its direct channel
    max_n_ctx: int = 0
    compute_lock_path: str = ""  # at most compute_slots workers compute at once (across processes)
    compute_slots: int = 1
    seqs_per_worker: int = 0  # > 0: batched workers (kvpool.batched_worker), each serving this many sessions


class WorkerHandle:
    """The supervisor's side of one worker process: open / append / truncate / close_context return
    values or raise WorkerFailed (the worker refused: code, length) or WorkerLost; nothing else of the
    pipe protocol leaves this class."""

    def __init__(self, name: str, spec: PoolSpec, index: int = 0) -> None:
        self.name = name
        self.direct_address = f"kvpool-{os.getpid()}-{name}-{secrets.token_hex(6)}" if spec.direct and not spec.seqs_per_worker else ""
        self.request_timeout_s = spec.request_timeout_s
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AnyWorkerReply)
        self._async_call_lock = asyncio.Lock()
        layout = spec.segment
        self.segment_bytes = layout.total_bytes
        self.segment = shared_memory.SharedMemory(create=True, size=layout.total_bytes)
        self.input_offset = layout.input_offset
        self.output_offset = layout.output_offset
        self.input_bytes = layout.input_bytes
        self.output_bytes = layout.output_bytes
        self._abort_flag = ctypes.c_int32.from_buffer(self.segment.buf, ABORT_FLAG_OFFSET)
        self.direct = DirectControls(self.segment.buf)
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe(duplex=True)
        self._connection: Connection = parent_end
        cancel_end, child_cancel_end = context.Pipe(duplex=True)
        self._cancel_connection: Connection = cancel_end
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
            direct_address=self.direct_address,
            max_n_ctx=spec.max_n_ctx,
            compute_lock_path=spec.compute_lock_path,
            compute_slots=spec.compute_slots,
            worker_index=index,
            n_seqs=spec.seqs_per_worker,
        )
        self.process = context.Process(target=worker_main, args=(child_end, worker_spec, child_cancel_end), name=name, daemon=True)
        self.process.start()
        child_end.close()  # so a dead worker reads as EOF on our end
        child_cancel_end.close()
        self.ready: Ready | None = None
        self.baseline_uss = 0
        self.lost = False

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
            return psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
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

    async def _call(self, command: AnyCommand) -> AnyWorkerReply:
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

    async def _expect(self, command: AnyCommand, expected: type):
        reply = await self._call(command)
        if isinstance(reply, Failed):
            raise WorkerFailed(reply.code, reply.message, reply.length)
        if not isinstance(reply, expected):
            raise WorkerFailed("internal", f"{self.name} answered {type(command).__name__} with {type(reply).__name__}", 0)
        return reply

    async def open(self, n_ctx: int) -> None:
        """A fresh context of n_ctx positions (the previous one, if any, is freed first)."""
        await self._expect(OpenContext(n_ctx=n_ctx), Opened)

    async def append(self, start_pos: int, rows: np.ndarray, output_rows: str = "last", sample: Sampling | None = None) -> WorkerOutput:
        """Append rows (int32 token ids on a first shard, float32 [n, n_embd] hidden states elsewhere);
        with `sample` (last shard) the worker picks the next token."""
        self.write_input(rows)
        command = RunAppend(start_pos=start_pos, n_rows=len(rows), output_rows=output_rows, sample=sample)
        appended = await self._expect(command, Appended)
        return WorkerOutput(
            length=appended.length, rows=appended.rows, width=appended.width, data=self.read_output(appended),
            token=appended.token, top_ids=appended.top_ids, top_logprobs=appended.top_logprobs,
        )

    async def truncate(self, length: int) -> int:
        return (await self._expect(TruncateContext(length=length), Truncated)).length

    async def close_context(self) -> None:
        await self._expect(CloseContext(), Closed)

    async def save_state(self) -> bytes:
        """The open context's sequence state (positions [0, length))."""
        return (await self._expect(SaveState(), Saved)).blob

    async def restore_state(self, n_ctx: int, blob: bytes, length: int) -> int:
        """A fresh context loaded with `blob`, cut to `length`; WorkerFailed code restore_failed if refused."""
        return (await self._expect(RestoreState(n_ctx=n_ctx, blob=blob, length=length), Restored)).length

    async def bind_channel(self, session_id: str, epoch: int) -> int:
        """The direct channel serves (session_id, epoch) until the next command; returns the length."""
        return (await self._expect(BindChannel(session_id=session_id, epoch=epoch), ChannelState)).length

    async def revoke_channel(self) -> int:
        """No more direct appends (one in flight completes first); returns the context's length."""
        return (await self._expect(RevokeChannel(), ChannelState)).length

    def cancel_direct(self, session_id: str, epoch: int, request_id: int) -> None:
        """Forward a cancel of the direct append `request_id` to the worker's cancel thread (no reply awaited)."""
        if self.lost or self.segment is None:
            return
        try:
            self._cancel_connection.send_bytes(self._encoder.encode(CancelDirect(session_id=session_id, epoch=epoch, request_id=request_id)))
        except OSError:
            pass  # the worker is gone: nothing to cancel

    def set_abort(self, value: bool) -> None:
        if self.segment is None:
            return  # stopped: nothing left to abort
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
        self._release_segment()

    def _release_segment(self) -> None:
        if self.segment is None:
            return
        del self._abort_flag
        self.direct.release()
        try:
            self.segment.close()
        except BufferError:
            pass  # a reader still holds a view; the mapping goes with the process
        try:
            self.segment.unlink()
        except FileNotFoundError:
            pass
        self.segment = None  # type: ignore[assignment]

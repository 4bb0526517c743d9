"""The worker process: loads one shard once, holds at most one live context, obeys the supervisor's pipe.

Started with the `spawn` method by kvpool.daemon.pool.pool; knows nothing of budgets, sessions or other workers.
A worker never outlives its supervisor: it exits when the pipe reaches EOF (while idle) and, from a
watchdog thread, as soon as its parent process changes (the supervisor died, even mid-decode).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import selectors
import signal
import threading
import time
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import msgspec

from workers.runtime.model import ShardModel
from workers.server import compute_semaphore
from workers.server.batched_server import BatchedWorkerServer
from workers.server.commands import AnyCommand, Exit, Failed, Ready
from workers.server.direct import DirectChannel
from workers.server.keep_warm_stamp import Stamp
from workers.server.pipe import received_command, send_reply
from workers.server.readings import anonymous_bytes, huge_page_bytes
from workers.server.single import WorkerServer
from workers.server.spec import WorkerSpec

PARENT_CHECK_INTERVAL_S = 0.2
ORPHAN_WAIT_S = 10.0  # after the pipe's EOF, how long the re-parenting that follows a supervisor's death is looked for
# glibc's mmap threshold, fixed at its default (128 KiB). Left dynamic, glibc raises it to the size of each
# mmap'd block freed (up to 32 MiB), so after the first context is freed the next one's KV cache and
# buffers come from the heap, where what it frees stays resident by its history: the start-up probe read
# a first context's growth (88.0 MiB, middle shard, n_ctx 2048) and a session's second context grew
# 86.6-86.9 MiB. Fixed, every block of 128 KiB or more is its own mapping, unmapped when freed: each
# context costs what the first did (84.8 probed, 84.9 grown, in every run), and a freed context's memory
# goes back to the OS at once. Setting it also stops glibc moving its trim threshold.
M_MMAP_THRESHOLD = -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 128 * 1024


def _orphaned(parent_pid: int, semaphore_id: int, *, within_s: float = 0.0) -> bool:
    """Whether `parent_pid` is no longer our parent (it died: we were re-parented), looking for up to `within_s`;
    if so, remove the daemon's compute semaphore (`semaphore_id`; -1: none), which the kernel would keep (the
    first of the workers to find the supervisor gone removes it; the rest find it gone)."""
    deadline = time.monotonic() + within_s
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    if semaphore_id >= 0:
        with contextlib.suppress(OSError):
            compute_semaphore.remove(semaphore_id)
    return True


def _exit_with_parent(parent_pid: int, semaphore_id: int) -> None:
    """Exit the whole process as soon as `parent_pid` is no longer our parent (_orphaned)."""

    def watch() -> None:
        while not _orphaned(parent_pid, semaphore_id):
            time.sleep(PARENT_CHECK_INTERVAL_S)
        os._exit(1)

    if _orphaned(parent_pid, semaphore_id):
        os._exit(1)
    threading.Thread(target=watch, name="kvpool-parent-watch", daemon=True).start()


def fix_allocator() -> bool:
    """Fix glibc's mmap threshold (above) before the model or a context allocates; False where the C library
    has no mallopt (not glibc: nothing to fix the same way)."""
    libc_name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(libc_name), "mallopt", None) if libc_name else None
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


def worker_main(connection: Connection, spec: WorkerSpec, cancel_connection: Connection | None = None, *, idle_spin: str = "") -> None:
    """`idle_spin`: what workers.server.spin.set_idle_spin set before llama.cpp loaded, reported in Ready."""
    fix_allocator()
    _exit_with_parent(spec.parent_pid, spec.compute_semaphore)
    # The supervisor owns shutdown: a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    encoder = msgspec.msgpack.Encoder()
    # The supervisor created the segment and unlinks it; a spawned worker shares the supervisor's
    # resource tracker, so attaching here registers nothing new.
    segment = shared_memory.SharedMemory(name=spec.shm_name)
    try:
        model = ShardModel(
            spec.shard_path,
            n_threads=spec.n_threads,
            flash_attn=spec.flash_attn,
            n_gpu_layers=spec.n_gpu_layers,
            verbose=spec.verbose,
            huge_pages=spec.huge_pages,
        )
    except Exception as error:  # noqa: BLE001 - reported to the supervisor, which refuses to start
        connection.send_bytes(encoder.encode(Failed(code="load_failed", message=str(error))))
        return
    before = anonymous_bytes()
    try:
        server = BatchedWorkerServer(model, segment, spec) if spec.seqs_per_worker else WorkerServer(model, segment, spec)
    except Exception as error:  # noqa: BLE001 - reported to the supervisor, which refuses to start
        connection.send_bytes(encoder.encode(Failed(code="load_failed", message=f"creating the batched context: {error}")))
        model.close()
        return
    server.release_free_heap()  # so the supervisor's baseline reading is the settled one
    connection.send_bytes(
        encoder.encode(
            Ready(
                pid=os.getpid(),
                shape=model.shape,
                kv_bytes_per_position=model.kv_bytes_per_position(),
                context_bytes=max(anonymous_bytes() - before, 0) if spec.seqs_per_worker else 0,
                huge_page_bytes=huge_page_bytes(),
                huge_pages=model.huge_pages.describe(),
                idle_spin=idle_spin,
            )
        )
    )
    selector = selectors.DefaultSelector()
    selector.register(connection.fileno(), selectors.EVENT_READ, None)
    # The --keep-warm block: attached as the segment is (the supervisor's resource tracker already holds it).
    warm_block = shared_memory.SharedMemory(name=spec.keep_warm_block) if spec.keep_warm_block and spec.direct_address else None
    channel = (
        DirectChannel(
            spec.direct_address, server, segment, cancel_connection, selector, spec.frame_deadline_s,
            keep_warm=Stamp(warm_block.buf) if warm_block is not None else None, max_frame_bytes=spec.max_request_bytes,
        )
        if spec.direct_address else None
    )
    try:
        if _obey(connection, server, channel, selector) == "eof":  # the supervisor is gone: the kernel re-parents us a moment after
            _orphaned(spec.parent_pid, spec.compute_semaphore, within_s=ORPHAN_WAIT_S)
    finally:
        # Every view of the segment goes before it closes (a view left over makes close() fail).
        if channel is not None:
            channel.close()
        server.close()
        model.close()
        selector.close()
        segment.close()
        if warm_block is not None:
            warm_block.close()


def _obey(connection: Connection, server: WorkerServer | BatchedWorkerServer, channel: DirectChannel | None, selector: selectors.BaseSelector) -> str:
    """Obey the pipe, and serve the direct channel between its commands, until Exit or the pipe's EOF (which of
    them it was: "exit" or "eof"). The
    loop never waits on a peer (workers.server.direct): only in select, where the time counts against the frames
    passing on the channel."""
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(AnyCommand)
    while True:
        wait = channel.next_wait() if channel is not None else None
        before = time.monotonic()
        idle = server.idle_in(before)
        if idle is not None:
            wait = idle if wait is None else min(wait, idle)
        events = selector.select(wait)
        if channel is not None:
            channel.waited(time.monotonic() - before)
        for key, ready in events:
            if key.data is not None:
                channel.ready(key.data, ready)
                continue
            try:
                with received_command(connection, decoder) as command:
                    if isinstance(command, Exit):
                        return "exit"
                    reply = server.handle(command)
                    send_reply(connection, encoder, reply)  # in the block: a restored state's mapping goes after the reply (0.7 ms at 3.76 MiB)
            except EOFError:
                return "eof"  # the supervisor is gone
        if not events:
            server.idle(time.monotonic())  # nothing came while the worker waited: its idle work, if due

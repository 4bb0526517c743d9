"""Cancels of the direct channel's appends. The supervisor (the authority on cancel) forwards a client's
cancel, naming the append's request id, over a second pipe read by a thread of the worker, so it lands
while the main thread computes. Under one lock with the main thread: the append computing now is aborted
(the abort flag); one not started yet is remembered and answered `cancelled` when it starts; a cancel
that names an append already done changes nothing. The supervisor does not wait for the thread: a
stopped worker must not hold up a cancel (the request timeout deals with a stopped worker)."""

from __future__ import annotations

import collections
import threading
from multiprocessing.connection import Connection

import msgspec

from workers.server.commands import CancelDirect

Key = tuple[str, int]
REMEMBERED_DONE = 4096


class DirectCancels:
    def __init__(self, connection: Connection, abort_flag) -> None:
        self._connection = connection
        self._abort = abort_flag  # ctypes int32 in the shared segment, read by llama.cpp's abort callback; None once released
        self._lock = threading.Lock()
        self._current: tuple[Key, int] | None = None
        self._pending: dict[Key, int] = {}
        self._done: collections.OrderedDict[tuple[Key, int], None] = collections.OrderedDict()
        threading.Thread(target=self._serve, name="kvpool-direct-cancels", daemon=True).start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(CancelDirect)
        while True:
            try:
                command = decoder.decode(self._connection.recv_bytes())
            except (EOFError, OSError):
                return
            self._cancel((command.session_id, command.epoch), command.request_id)

    def _cancel(self, key: Key, request_id: int) -> str:
        with self._lock:
            if self._abort is None:
                return "nothing in flight"  # released: the worker is stopping
            if self._current == (key, request_id):
                self._abort.value = 1
                return "cancel requested"
            if (key, request_id) in self._done:
                return "nothing in flight"
            self._pending[key] = request_id  # sent, not read yet: cancelled as it starts
            return "cancel requested"

    def begin(self, key: Key, request_id: int) -> bool:
        """False: this append was cancelled before it started (answer cancelled, compute nothing)."""
        with self._lock:
            cancelled = self._pending.pop(key, None) == request_id  # another id pending is stale: a session's appends are sequential
            if cancelled:
                self._remember_done(key, request_id)
                return False
            self._current = (key, request_id)
            self._abort.value = 0
            return True

    def end(self, key: Key, request_id: int) -> None:
        with self._lock:
            self._current = None
            self._abort.value = 0  # a cancel that arrived as the append finished must not outlive it
            self._remember_done(key, request_id)

    def release(self) -> None:
        """Drop the view of the abort flag (the segment is about to be closed); later cancels change nothing."""
        with self._lock:
            self._abort = None

    def _remember_done(self, key: Key, request_id: int) -> None:
        self._done[(key, request_id)] = None
        while len(self._done) > REMEMBERED_DONE:
            self._done.popitem(last=False)

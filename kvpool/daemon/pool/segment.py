"""The supervisor's side of one worker's shared-memory segment (its offsets: workers.server.segment): the abort flag,
the direct channel's control words, the input rows written before an append and its output rows read
after. The segment is created before its worker starts and released once, after it has stopped."""

from __future__ import annotations

import ctypes
from multiprocessing import shared_memory

import numpy as np

from kvpool.daemon.pool.controls import DirectControls
from workers.server.commands import Appended
from workers.server.segment import ABORT_FLAG_OFFSET, SegmentRegions


class WorkerSegment:
    def __init__(self, regions: SegmentRegions) -> None:
        self.regions = regions
        self.memory: shared_memory.SharedMemory | None = shared_memory.SharedMemory(create=True, size=regions.total_bytes)
        self._abort_flag = ctypes.c_int32.from_buffer(self.memory.buf, ABORT_FLAG_OFFSET)
        self.direct = DirectControls(self.memory.buf)

    def set_abort(self, value: bool) -> None:
        if self.memory is None:
            return  # released: nothing left to abort
        self._abort_flag.value = 1 if value else 0

    def write_input(self, rows: np.ndarray) -> None:
        view = np.frombuffer(self.memory.buf, rows.dtype, rows.size, self.regions.input_offset)
        view[:] = rows.reshape(-1)

    def read_output(self, appended: Appended) -> bytes:
        if appended.inline:
            return appended.inline
        start = self.regions.output_offset
        return bytes(self.memory.buf[start : start + appended.rows * appended.width * 4])

    def release(self) -> None:
        """Close and unlink the segment. Idempotent."""
        if self.memory is None:
            return
        del self._abort_flag
        self.direct.release()
        try:
            self.memory.close()
        except BufferError:
            pass  # a reader still holds a view; the mapping goes with the process
        try:
            self.memory.unlink()
        except FileNotFoundError:
            pass
        self.memory = None

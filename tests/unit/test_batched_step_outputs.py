"""Where a batched worker has a batch's one-row outputs written (workers.server.batched_server): rows of one block
it keeps from batch to batch, a row an item, never two items on one row; any other append gets a new array."""

from __future__ import annotations

import numpy as np

from workers.server.batched_server import BatchedWorkerServer


def _server(width: int) -> BatchedWorkerServer:
    """Only the kept block: _step_outputs reads nothing else (the model and the segment play no part in it)."""
    server = object.__new__(BatchedWorkerServer)
    server._step_rows = np.empty((0, width), np.float32)
    return server


def _spans(outputs: list[np.ndarray | None]) -> list[tuple[int, int]]:
    return sorted((out.ctypes.data, out.ctypes.data + out.nbytes) for out in outputs if out is not None)


def test_one_row_items_get_distinct_rows_of_one_kept_block_and_others_none() -> None:
    server = _server(width=8)
    first = server._step_outputs([1, 3, 1])
    assert first[1] is None
    assert [out.shape for out in (first[0], first[2])] == [(1, 8), (1, 8)]
    assert all(out.dtype == np.float32 and out.flags.c_contiguous for out in (first[0], first[2]))
    spans = _spans(first)
    assert spans[0][1] <= spans[1][0]  # no two items on one row
    second = server._step_outputs([1, 1])
    assert _spans(second) == spans  # the next batch writes where the last one did: no new allocation
    grown = server._step_outputs([1, 1, 1, 5])
    assert grown[3] is None and len(_spans(grown)) == 3
    assert all(end <= start for (_s, end), (start, _e) in zip(_spans(grown), _spans(grown)[1:]))
    assert _spans(server._step_outputs([1, 1, 1])) == _spans(grown)
    assert server._step_outputs([4, 2]) == [None, None]

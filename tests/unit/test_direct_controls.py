"""The supervisor's reading of a worker's direct-channel control words (kvpool.daemon.pool.controls): the length
and the time of the last direct append are taken as one reading, even when the worker writes them mid-read."""

from __future__ import annotations

from kvpool.daemon.pool.controls import DirectControls
from workers.server.direct_words import DirectWords
from workers.server.segment import CONTROL_BYTES


class _EndsAnAppendWhenRead:
    """Stands for the length word: reading it returns what it holds, then the worker ends an append (writes the new
    length, then its time, as workers.server.direct does), once."""

    def __init__(self, words: DirectWords, length: int, ended: float) -> None:
        self._words, self._next = words, (length, ended)
        self._real = words.length

    @property
    def value(self) -> int:
        value = self._real.value
        if self._next is not None:
            (self._real.value, self._words.last_used.value), self._next = self._next, None
        return value


def test_a_length_read_as_an_append_ends_is_not_paired_with_the_next_appends_time() -> None:
    buffer = bytearray(CONTROL_BYTES)
    worker = DirectWords(buffer)
    worker.length.value, worker.last_used.value = 5, 100.0
    controls = DirectControls(buffer)
    assert controls.activity() == (False, 5, 100.0)
    real = controls._words.length
    controls._words.length = _EndsAnAppendWhenRead(worker, 6, 101.0)
    try:
        assert controls.activity() == (False, 6, 101.0)  # not (False, 5, 101.0): the old length with the new time
    finally:
        controls._words.length = real
    assert controls.activity() == (False, 6, 101.0)
    controls.release()
    worker.release()

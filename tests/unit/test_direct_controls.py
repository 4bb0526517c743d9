"""The supervisor's reading of a worker's direct-channel control words (kvpool.daemon.pool.controls, and what
kvpool.daemon.pool.channels takes of it): the length and the time of the last direct append are taken as one
reading, even when the worker writes them mid-read, and taken once their time is written, whenever the
supervisor looked before."""

from __future__ import annotations

import time

from kvpool.daemon.books.sessions import Session
from kvpool.daemon.pool.channels import Channels
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


class _Worker:
    """What Channels reads of a pool's worker: its direct-channel control words."""

    def __init__(self, buffer: bytearray) -> None:
        self.direct = DirectControls(buffer)


class _Pool:
    def __init__(self, worker: _Worker) -> None:
        self._worker = worker

    def get(self, _name: str) -> _Worker:
        return self._worker


def test_a_direct_append_seen_busy_as_it_ends_is_taken_once_its_time_is_written() -> None:
    """The worker ends a direct append: the length, then its clock read, then the time written, then busy cleared
    (workers.server.direct). A look between the clock read and the time written sees busy and the new length with the
    old time, and marks the session used now, after the append's time: the books must still take the length when the
    time lands (before, a length was taken only with a time later than the session's last use: never, here)."""
    buffer = bytearray(CONTROL_BYTES)
    worker = DirectWords(buffer)
    worker.length.value, worker.last_used.value = 10, time.monotonic()  # a direct append of another session, before
    channels = Channels(None, _Pool(_Worker(buffer)), None, enabled=True)
    session = Session("s", 1, 64, 1000, "w", length=10, last_used=time.monotonic())
    assert channels.binding(session) is not None
    session.channel = True
    assert not channels._read(session) and session.length == 10  # the words are the other session's: not taken
    worker.busy.value = 1
    worker.length.value = 11
    ended = time.monotonic()
    assert channels._read(session) and session.length == 10 and session.last_used > ended  # busy: the time not written yet
    worker.last_used.value = ended
    worker.busy.value = 0
    assert not channels._read(session) and session.length == 11
    assert not channels._read(session) and session.length == 11
    other = Session("t", 1, 64, 1000, "w", length=3, last_used=time.monotonic())
    channels.binding(other)  # the worker's next session: its words are the last one's until it appends
    other.channel = True
    assert not channels._read(other) and other.length == 3
    worker.release()

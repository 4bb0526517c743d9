"""A worker's spare context on the real model (workers.server.single.WorkerServer, in process): a park's
SaveState(keep), or a release's CloseContext(keep), leaves no open context, only the spare; the spare is zeroed once idle or before another takes
it; a restore or an open of its n_ctx takes it, any other n_ctx frees it; a context a refused restore touched
never becomes one; its own park's restore resumes its cells; and what a restored spare computes is bit for bit
what a fresh context computes."""

from __future__ import annotations

import math
import mmap
import os
import threading
from multiprocessing import shared_memory

import llama_cpp
import numpy as np
import pytest

from tests.conftest import EVEN_SPLIT
from tests.support.worker_server import worker_server
from workers.runtime.context import ShardContext
from workers.runtime.model import ShardModel
from workers.server.background import BACKGROUND_NICE
from workers.server.commands import Appended, CloseContext, Closed, Failed, OpenContext, Opened, Restored, RestoreState, RunAppend, Saved, SaveState, TruncateContext
from workers.server.pipe import WrittenState
from workers.server.segment import SegmentRegions

N_CTX = 32
PROMPT = np.array([1, 502, 3441, 28, 314, 1789], np.int32)


@pytest.fixture(scope="module")
def first_model(shard_sets):
    with ShardModel(shard_sets[EVEN_SPLIT][0].path) as model:
        yield model


@pytest.fixture
def server(first_model, resource_tracker_running):
    shape = first_model.shape
    segment = shared_memory.SharedMemory(create=True, size=SegmentRegions(N_CTX * 4, N_CTX * shape.n_embd * 4).total_bytes)
    worker = worker_server(first_model, segment, N_CTX, shape.n_embd, N_CTX)
    try:
        yield worker
    finally:
        worker.close()
        segment.close()
        segment.unlink()


def _append(server, start: int, tokens: np.ndarray, n_ctx: int = 0):
    server._input[: tokens.nbytes] = tokens.tobytes()
    reply = server.handle(RunAppend(start_pos=start, n_rows=len(tokens), output_rows="all", n_ctx=n_ctx))
    assert not isinstance(reply, Failed), reply
    return np.frombuffer(server._buffer, np.float32, len(tokens) * server.model.shape.n_embd, server.spec.segment.output_offset).copy()


def test_a_kept_context_is_a_spare_only_an_open_of_its_n_ctx_takes_and_it_computes_as_a_fresh_one(server, first_model):
    _append(server, 0, PROMPT[:4], n_ctx=N_CTX)
    saved = server.handle(SaveState(keep=True))
    assert isinstance(saved, Saved) and saved.length == 4 and server.context is None and server.spare is not None
    for command in (RunAppend(start_pos=0, n_rows=1), TruncateContext(length=0), SaveState()):
        assert isinstance(reply := server.handle(command), Failed) and reply.code == "no_context"  # the spare is no open context
    assert server.idle_in(0.0) is not None and server.idle_in(math.inf) == 0.0  # idle work due: the spare's zeroing
    server.idle(math.inf)  # as the command loop does once the worker sat idle: the KV zeroed
    assert server.idle_in(math.inf) is None
    restored = server.handle(RestoreState(n_ctx=N_CTX, length=4, blob=memoryview(saved.blob)))
    assert restored == Restored(length=4, reused=True) and server.spare is None
    continued = _append(server, 4, PROMPT[4:])
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:4])
        assert np.array_equal(continued.reshape(2, -1), fresh.append(4, tokens=PROMPT[4:]))
    server.handle(SaveState(keep=True, owner=7))  # not zeroed before a new session takes it: the open zeroes it
    assert server.handle(OpenContext(n_ctx=N_CTX)) == Opened(n_ctx=N_CTX, reused=True)
    assert server.context.length == 0  # a new session in it starts empty, and computes as in a fresh context:
    with first_model.new_context(N_CTX) as fresh:
        assert np.array_equal(_append(server, 0, PROMPT).reshape(len(PROMPT), -1), fresh.append(0, tokens=PROMPT, output_rows="all"))


def test_a_released_context_is_kept_as_a_spare_zeroed_before_any_session_takes_it(server, first_model, monkeypatch):
    """CloseContext(keep) - a release - keeps the open context as the spare, its cells no park's: the next admission
    of its n_ctx (a RunAppend that opens one) takes it zeroed (Appended.reused) and computes bit for bit as a fresh
    context; so does a restore, even one naming a park token; a plain CloseContext frees spare and context."""
    zeroed = []
    _append(server, 0, PROMPT, n_ctx=N_CTX)
    assert server.handle(CloseContext(keep=True)) == Closed() and server.context is None and server.spare is not None
    assert server.idle_in(math.inf) == 0.0  # idle work due: the released KV's zeroing
    clear = server.spare.clear
    monkeypatch.setattr(server.spare, "clear", lambda *, data: (data and zeroed.append(data), clear(data=data)))
    server._input[:8] = PROMPT[:2].tobytes()
    admitted = server.handle(RunAppend(start_pos=0, n_rows=2, output_rows="all", n_ctx=N_CTX))
    assert isinstance(admitted, Appended) and admitted.reused and admitted.length == 2 and zeroed == [True]
    rows = np.frombuffer(server._buffer, np.float32, 2 * first_model.shape.n_embd, server.spec.segment.output_offset).reshape(2, -1)
    with first_model.new_context(N_CTX) as fresh:  # the released history's first two tokens, computed afresh
        assert np.array_equal(rows, fresh.append(0, tokens=PROMPT[:2], output_rows="all"))
    _append(server, 2, PROMPT[2:4])
    saved = server.handle(SaveState())
    assert server.handle(CloseContext(keep=True)) == Closed()
    restored = server.handle(RestoreState(n_ctx=N_CTX, length=4, blob=memoryview(saved.blob), owner=5))
    assert restored == Restored(length=4, reused=True) and zeroed == [True, True]  # no park left it: zeroed, then loaded
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:4])
        assert np.array_equal(_append(server, 4, PROMPT[4:]).reshape(2, -1), fresh.append(4, tokens=PROMPT[4:]))
    assert server.handle(CloseContext(keep=True)) == Closed() and server.spare is not None
    spare = server.spare
    refused = server.handle(CloseContext(keep=True))  # nothing open to keep: refused, the spare left as it is
    assert isinstance(refused, Failed) and refused.code == "no_context" and server.spare is spare
    assert server.handle(CloseContext()) == Closed() and server.context is None and server.spare is None
    second = server.handle(RunAppend(start_pos=0, n_rows=1, n_ctx=N_CTX))
    assert isinstance(second, Appended) and not second.reused


def test_another_n_ctx_frees_the_spare_and_a_refused_restore_never_leaves_one(server):
    _append(server, 0, PROMPT[:3], n_ctx=N_CTX)
    saved = server.handle(SaveState(keep=True))
    assert server.handle(OpenContext(n_ctx=N_CTX // 2)) == Opened(n_ctx=N_CTX // 2, reused=False) and server.spare is None
    server.handle(SaveState(keep=True))
    damaged = bytearray(saved.blob)
    damaged[-1] ^= 0xFF  # the last layer's data: framing holds, llama.cpp may read it or refuse the whole
    damaged[8:12] = (10_000).to_bytes(4, "little")  # a cell count beyond the context: refused
    refused = server.handle(RestoreState(n_ctx=N_CTX // 2, length=3, blob=memoryview(bytes(damaged))))
    assert isinstance(refused, Failed) and refused.code == "restore_failed"
    assert server.context is None and server.spare is None  # the context it touched is freed, never kept


def test_a_spare_goes_back_to_its_own_park_unzeroed_and_to_any_other_zeroed(server, first_model, monkeypatch):
    """The KV a park left in its spare is zeroed before the restore of any other park (another session, or the
    same key parked again: each park has its own token) takes the spare, not before its own (whose cells the
    restore writes again); both continue bit for bit as fresh contexts."""
    zeroed = []
    _append(server, 0, PROMPT[:4], n_ctx=N_CTX)
    saved = server.handle(SaveState(keep=True, owner=1))
    clear = server.spare.clear
    monkeypatch.setattr(server.spare, "clear", lambda *, data: (data and zeroed.append(data), clear(data=data)))  # the zeroings only
    assert server.handle(RestoreState(n_ctx=N_CTX, length=4, blob=memoryview(saved.blob), owner=1)).reused
    assert zeroed == [] and server.idle_in(math.inf) is None
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:4])
        assert np.array_equal(_append(server, 4, PROMPT[4:]).reshape(2, -1), fresh.append(4, tokens=PROMPT[4:]))
    other = server.handle(SaveState(keep=True, owner=2))  # a's 6 positions stay in the spare's buffers
    assert server.handle(RestoreState(n_ctx=N_CTX, length=4, blob=memoryview(saved.blob), owner=3)).reused
    assert zeroed == [True]  # another session: zeroed first (the clear patched on the same context)
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:4])
        assert np.array_equal(_append(server, 4, PROMPT[4:]).reshape(2, -1), fresh.append(4, tokens=PROMPT[4:]))
    assert other.length == 6


def test_a_parks_own_restore_loads_nothing_keeps_the_cells_and_continues_bit_for_bit(server, first_model, monkeypatch):
    """The restore of a spare's own park, unzeroed, resumes the cells that park saved (Restored.in_place): no
    llama.cpp load (restore_state never runs), cut to a shorter length when a truncate came while parked; its
    next appends are those of a context that was never parked. A spare whose cells no longer hold what its
    park saved is loaded from the blob instead, as any other."""
    loads = []
    _append(server, 0, PROMPT[:5], n_ctx=N_CTX)
    saved = server.handle(SaveState(keep=True, owner=11))
    assert server.spare.length == 5  # the cells stay: a park does not empty its spare
    monkeypatch.setattr(type(server.spare), "restore_state", lambda context, blob, length: loads.append(length))
    restored = server.handle(RestoreState(n_ctx=N_CTX, length=5, blob=memoryview(saved.blob), owner=11))
    assert restored == Restored(length=5, reused=True, in_place=True) and loads == [] and server.idle_in(math.inf) is None
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:5])
        assert np.array_equal(_append(server, 5, PROMPT[5:]).reshape(1, -1), fresh.append(5, tokens=PROMPT[5:]))

    six = server.handle(SaveState(keep=True, owner=12))  # 6 positions parked; the session truncated to 3 while parked
    restored = server.handle(RestoreState(n_ctx=N_CTX, length=3, blob=memoryview(six.blob), owner=12))
    assert restored == Restored(length=3, reused=True, in_place=True) and loads == [] and server.context.length == 3
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:3])
        assert np.array_equal(_append(server, 3, PROMPT[3:5]).reshape(2, -1), fresh.append(3, tokens=PROMPT[3:5], output_rows="all"))
    monkeypatch.undo()

    resaved = server.handle(SaveState(keep=True, owner=13))  # 5 positions; then its cells are cut behind its back
    llama_cpp.llama_memory_seq_rm(server.spare._memory, 0, 2, -1)
    restored = server.handle(RestoreState(n_ctx=N_CTX, length=5, blob=memoryview(resaved.blob), owner=13))
    assert restored == Restored(length=5, reused=True, in_place=False)  # loaded from the blob: the cells were not the park's
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:5])
        assert np.array_equal(_append(server, 5, PROMPT[5:]).reshape(1, -1), fresh.append(5, tokens=PROMPT[5:]))


def test_a_save_no_caller_waits_for_runs_at_a_lower_priority_and_saves_the_same_state(server, first_model, monkeypatch):
    """SaveState.behind (a park answered before its save): the save runs in the worker's background thread at a
    lower priority (workers.server.background), its bytes those of a save in the loop's own thread, into the
    memfd that travels (room asked for around them, as the supervisor always asks) as into bytes; its own restore
    resumes in place."""
    saves = []
    for name in ("save_state", "save_state_to_memfd"):
        save = getattr(ShardContext, name)

        def recording(context, *args, _save=save):
            thread = threading.get_native_id()
            saves.append((thread, os.getpriority(os.PRIO_PROCESS, thread)))
            return _save(context, *args)

        monkeypatch.setattr(ShardContext, name, recording)
    _append(server, 0, PROMPT[:5], n_ctx=N_CTX)
    waited = server.handle(SaveState(keep=True, owner=21))
    assert server.handle(RestoreState(n_ctx=N_CTX, length=5, blob=memoryview(waited.blob), owner=21)).in_place
    behind = server.handle(SaveState(keep=True, owner=22, behind=True))
    assert isinstance(behind, Saved) and behind.length == 5 and bytes(behind.blob) == bytes(waited.blob)
    assert server.handle(RestoreState(n_ctx=N_CTX, length=5, blob=memoryview(behind.blob), owner=22)) == Restored(length=5, reused=True, in_place=True)
    with_room = server.handle(SaveState(keep=True, owner=23, head=16, tail=4, behind=True))
    assert isinstance(with_room.blob, WrittenState) and with_room.blob.nbytes == len(waited.blob)
    with mmap.mmap(with_room.blob.fd, 16 + len(waited.blob) + 4, access=mmap.ACCESS_READ) as written:
        assert written[16 : 16 + len(waited.blob)] == bytes(waited.blob) and written[:16] == bytes(16) and written[-4:] == bytes(4)
    os.close(with_room.blob.fd)
    caller = (threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert saves[0] == caller and saves[1] == saves[2] and saves[1][0] != caller[0] and saves[1][1] == min(19, caller[1] + BACKGROUND_NICE)
    assert server.handle(RestoreState(n_ctx=N_CTX, length=5, blob=memoryview(waited.blob), owner=23)).in_place
    with first_model.new_context(N_CTX) as fresh:
        fresh.append(0, tokens=PROMPT[:5])
        assert np.array_equal(_append(server, 5, PROMPT[5:]).reshape(1, -1), fresh.append(5, tokens=PROMPT[5:]))


def test_with_background_nice_0_a_save_no_caller_waits_for_runs_in_the_loops_own_thread(first_model, resource_tracker_running, monkeypatch):
    """--background-nice 0: no background thread; a behind save is the loop's own call, its bytes the same."""
    shape = first_model.shape
    segment = shared_memory.SharedMemory(create=True, size=SegmentRegions(N_CTX * 4, N_CTX * shape.n_embd * 4).total_bytes)
    server = worker_server(first_model, segment, N_CTX, shape.n_embd, N_CTX, background_nice=0)
    try:
        assert server.background is None
        threads = []
        save = ShardContext.save_state
        monkeypatch.setattr(ShardContext, "save_state", lambda context: (threads.append(threading.get_native_id()), save(context))[1])
        _append(server, 0, PROMPT[:5], n_ctx=N_CTX)
        waited = server.handle(SaveState(keep=True, owner=31))
        assert server.handle(RestoreState(n_ctx=N_CTX, length=5, blob=memoryview(waited.blob), owner=31)).in_place
        behind = server.handle(SaveState(keep=True, owner=32, behind=True))
        assert threads == [threading.get_native_id()] * 2 and bytes(behind.blob) == bytes(waited.blob)
    finally:
        server.close()
        segment.close()
        segment.unlink()

"""The direct channel: a bound session's appends go client -> worker, and the supervisor stays the
authority: whatever it does to the session first revokes the channel, and the next append gets exactly
the typed error (or restore) the supervisor gives."""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import time

import numpy as np
import pytest

from kvpool.client import KvpoolError
from tests.daemons import DaemonProcess, in_thread, joined, stopped, wait_until
from workers.compute_locks import ComputeLocks
from workers.runtime import ShardModel

N_CTX = 256
pytestmark = pytest.mark.timeout(3600)


def _serve(model_path, socket_dir, name, *options):
    return DaemonProcess(model_path, socket_dir / f"{name}.sock", "--threads", "1", "--n-ctx", str(N_CTX), *options)


def _error(call) -> KvpoolError:
    with pytest.raises(KvpoolError) as raised:
        call()
    return raised.value


def _direct_appends(client) -> int:
    return client.stats().counters["direct_appends"]


def test_appends_skip_the_supervisor_and_equal_the_supervisor_path(model_path, socket_dir, prompt_ids):
    daemon = _serve(model_path, socket_dir, "paths", "--max-sessions", "2")
    prompt = prompt_ids[0][:10]
    try:
        with daemon.client() as direct, daemon.client(direct=False) as plain:
            outputs = {}
            for name, client in (("d", direct), ("p", plain)):
                rows = [client.append(name, 1, 0, tokens=prompt).rows]
                for step in range(4):
                    rows.append(client.append(name, 1, 10 + step, tokens=[30 + step]).rows)
                outputs[name] = rows
            for left, right in zip(outputs["d"], outputs["p"]):
                assert np.array_equal(left, right)
            stats = plain.stats()
            assert stats.counters["direct_appends"] == 4 and stats.counters["appends"] == 6  # 1 + 5 through the supervisor
            assert {row.session_id: row.length for row in stats.sessions} == {"d": 14, "p": 14}
            # a direct append's errors are the supervisor's, word for word
            via_direct = _error(lambda: direct.append("d", 1, 3, tokens=[1]))
            assert (via_direct.code, via_direct.length) == ("position_mismatch", 14)
            direct_count = _direct_appends(plain)
            via_plain = _error(lambda: plain.append("d", 1, 3, tokens=[1]))
            assert (via_plain.code, via_plain.length, str(via_plain)) == (via_direct.code, via_direct.length, str(via_direct))
            assert _direct_appends(plain) == direct_count
            assert _error(lambda: direct.append("d", 1, 14, tokens=[10**6])).code == "bad_request"
            assert stats.integrity == "ok"
    finally:
        daemon.stop()


def test_revocation_release_epoch_eviction_truncate_and_park(model_path, socket_dir, whole_model, prompt_ids):
    daemon = _serve(model_path, socket_dir, "revoke", "--max-sessions", "1", "--spill-budget", "0")
    prompt = prompt_ids[1][:8]
    try:
        with daemon.client() as router, daemon.client(direct=False) as other:
            router.append("a", 1, 0, tokens=prompt)
            router.append("a", 1, 8, tokens=[5])  # direct now
            other.release("a", 1)
            assert _error(lambda: router.append("a", 1, 9, tokens=[5])).reason == "released"
            router.append("b", 1, 0, tokens=prompt)
            router.append("b", 1, 8, tokens=[5])
            other.append("b", 2, 0, tokens=prompt)  # a newer epoch fences the old one
            assert _error(lambda: router.append("b", 1, 9, tokens=[5])).code == "stale_epoch"
            router.append("c", 1, 0, tokens=prompt)  # the only place: evicts b (epoch 2), bound to its channel
            router.append("c", 1, 8, tokens=[5])
            other.append("d", 1, 0, tokens=prompt)  # evicts c
            assert _error(lambda: router.append("c", 1, 9, tokens=[5])).reason == "evicted"
            router.append("d", 1, 8, tokens=[5])
            assert other.truncate("d", 1, 4) == 4
            assert _error(lambda: router.append("d", 1, 9, tokens=[5])).code == "position_mismatch"
            got = router.append("d", 1, 4, tokens=[5])
            with whole_model.new_context(N_CTX) as reference:
                reference.append(0, tokens=np.asarray(prompt[:4], np.int32))
                assert np.array_equal(got.rows, reference.append(4, tokens=np.asarray([5], np.int32)))
            assert other.stats().integrity == "ok"
    finally:
        daemon.stop()
    parked = _serve(model_path, socket_dir, "revoke-park", "--max-sessions", "1")
    try:
        with parked.client() as router, parked.client(direct=False) as other:
            router.append("p", 1, 0, tokens=prompt)
            router.append("p", 1, 8, tokens=[5])
            other.park("p", 1)
            got = router.append("p", 1, 9, tokens=[6])
            assert got.restored
            with whole_model.new_context(N_CTX) as reference:
                reference.append(0, tokens=np.asarray(prompt, np.int32))
                reference.append(8, tokens=np.asarray([5], np.int32))
                assert np.array_equal(got.rows, reference.append(9, tokens=np.asarray([6], np.int32)))
    finally:
        parked.stop()


def test_cancel_reaches_a_direct_append_running_or_not_yet_read(model_path, socket_dir, tokenizer):
    daemon = _serve(model_path, socket_dir, "cancel", "--max-sessions", "2", "--n-ctx", "2048")
    long_prompt = tokenizer.encode(" ".join(f"word{i}" for i in range(900)))[:1900]
    try:
        with daemon.client() as client, daemon.client(direct=False) as observer:
            client.append("cancel", 1, 0, tokens=long_prompt[:10])
            client.append("cancel", 1, 10, tokens=long_prompt[10:12])  # bound: the next one goes direct
            worker_pid = observer.stats().sessions[0].worker_pid
            with stopped(worker_pid):
                thread, outcome = in_thread(lambda: client.append("cancel", 1, 12, tokens=long_prompt[12:]))
                wait_until(lambda: client.direct_in_flight("cancel", 1), "the direct append to be sent")
                canceller, cancelled = in_thread(lambda: client.cancel("cancel", 1))
                wait_until(lambda: observer.stats().counters["direct_cancels_forwarded"], "the cancel to reach the worker's pipe")
            assert joined(canceller, cancelled)["result"].detail == "cancel requested"
            error = joined(thread, outcome).get("error")
            assert isinstance(error, KvpoolError) and (error.code, error.length) == ("cancelled", 12), outcome
            assert observer.stats().sessions[0].length == 12
            logits = client.append("cancel", 1, 12, tokens=long_prompt[12:40]).rows
            fresh = observer.append("fresh", 1, 0, tokens=long_prompt[:40]).rows
            assert np.array_equal(logits, fresh)
            assert client.cancel("cancel", 1).detail == "nothing in flight"
    finally:
        daemon.stop()


def _hold(path: str, slot_count: int, preferred: int, ready, release) -> None:
    with ComputeLocks(path, slot_count, preferred):
        ready.set()
        if release is None:
            time.sleep(600)  # killed while holding the slot
        else:
            release.wait(60)


def test_compute_locks_bound_the_workers_computing_and_a_dead_holder_frees_its_slot():
    context = multiprocessing.get_context("fork")  # no resource tracker process left behind
    with tempfile.NamedTemporaryFile() as lock_file:
        lock_file.write(b"\0")
        lock_file.flush()
        holder_ready = context.Event()
        holder = context.Process(target=_hold, args=(lock_file.name, 1, 0, holder_ready, None))
        holder.start()
        assert holder_ready.wait(600)
        waiter_ready, release = context.Event(), context.Event()
        waiter = context.Process(target=_hold, args=(lock_file.name, 1, 0, waiter_ready, release))
        waiter.start()
        assert not waiter_ready.wait(0.5)  # the one slot is held
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(600)
        assert waiter_ready.wait(600)  # the kernel released the dead holder's lock
        release.set()
        waiter.join(600)
        assert waiter.exitcode == 0


@pytest.fixture(scope="module")
def whole_model(model_path):
    with ShardModel(model_path) as model:
        yield model


def test_an_idle_direct_session_is_the_least_recently_used_only_when_it_is(model_path, socket_dir, prompt_ids):
    daemon = _serve(model_path, socket_dir, "lru", "--max-sessions", "2", "--spill-budget", "0")
    prompt = prompt_ids[0][:6]
    try:
        with daemon.client() as client, daemon.client(direct=False) as other:
            client.append("old", 1, 0, tokens=prompt)
            other.append("busy", 1, 0, tokens=prompt)
            time.sleep(0.01)
            client.append("old", 1, 6, tokens=[1])  # a direct append: "old" is now the most recently used
            other.append("new", 1, 0, tokens=prompt)  # evicts "busy", not "old"
            assert {row.session_id for row in other.stats().sessions} == {"old", "new"}
    finally:
        daemon.stop()

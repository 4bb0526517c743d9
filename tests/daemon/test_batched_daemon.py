"""Batched mode end to end (issue 12): `kvpool serve --mode batched`, sessions as sequences of one context
in one worker process, their appends decoded together, the contract per session.

Batching is made deterministic where a test needs it by stopping the worker process (SIGSTOP): requests
then wait in the supervisor's queue for as long as the test wants, on any machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import numpy as np
import pytest

from kvpool.client.client import KvpoolError
from kvpool.daemon.pool.batched import BatchedWorker
from kvpool.daemon.pool.compute import ComputeSlots
from kvpool.daemon.pool.handle import PoolSpec, WorkerFailed, WorkerLost
from kvpool.router.router import Router
from kvpool.shard.header import read_shard_info
from tests.conftest import PROCESS_MODE_TOLERANCE
from tests.support.chains import daemon_chain, greedy_with_logits, release_all
from tests.support.daemons import DaemonProcess, in_thread, joined, result, stopped, wait_until
from tests.support.fake_daemon import N_EMBD, fake_shard_file
from tests.support.fake_worker import fake_kinds
from workers.runtime.model import ShardModel
from workers.server.commands import BatchDone, RunBatch, TruncateContext
from workers.server.segment import SegmentRegions
from workers.server.spec import WorkerSpec

N_CTX = 256
GREEDY = 8
HANG_GUARD_S = 600.0
pytestmark = pytest.mark.timeout(3600)
BATCHED = ("--mode", "batched", "--seqs-per-worker", "4", "--max-sessions", "4", "--threads", "1", "--n-ctx", str(N_CTX))


@pytest.fixture(scope="module")
def chain(shards, socket_dir):
    """Three batched daemons, one per shard: one worker process of 4 sequences each, one llama thread."""
    with daemon_chain([shard.path for shard in shards], socket_dir, "batched", *BATCHED) as daemons:
        yield daemons


@pytest.fixture
def daemons(chain):
    yield chain
    release_all(chain)


def _alone(local_chain, prompt):
    with local_chain.new_session(N_CTX) as session:
        return greedy_with_logits(session.append, prompt, GREEDY)


def _through(daemons, session_id, prompt):
    clients = [daemon.client() for daemon in daemons]
    try:
        return greedy_with_logits(Router(clients).session(session_id, epoch=1).append_at, prompt, GREEDY)
    finally:
        for client in clients:
            client.close()


def _worker_pid(daemon) -> int:
    with daemon.client() as client:
        pids = {row.pid for row in client.stats().workers}
    assert len(pids) == 1, pids  # one batched process holds the four sessions
    return pids.pop()


def test_four_concurrent_sessions_through_a_batched_chain_equal_each_alone(daemons, local_chain, prompt_ids, tokenizer):
    prompts = [prompt_ids[0], prompt_ids[1]] + [tokenizer.encode(tokenizer.chat_prompt(text)) for text in ("List four fruits.", "Why is the sky blue?")]
    expected = [_alone(local_chain, prompt) for prompt in prompts]
    outcomes = [in_thread(lambda index=index: _through(daemons, f"four-{index}", prompts[index])) for index in range(4)]
    for index, (thread, outcome) in enumerate(outcomes):
        tokens, logits = result(thread, outcome)
        assert tokens == expected[index][0], f"session {index} diverged"
        assert float(np.abs(logits - expected[index][1]).max()) <= PROCESS_MODE_TOLERANCE
    for daemon in daemons:
        with daemon.client() as client:
            stats = client.stats()
            assert stats.mode == "batched" and "4 sessions each" in stats.mode_detail
            assert len(stats.sessions) == 4 and stats.integrity == "ok"
            assert len({row.worker_pid for row in stats.sessions}) == 1  # four sessions, one process
            assert stats.counters["batched_appends"] >= stats.counters["appends"] > 0  # every append went through a batch


def test_appends_waiting_together_are_decoded_in_one_batch_and_each_gets_its_own_rows(daemons, shards, prompt_ids):
    daemon = daemons[0]  # the first shard: token ids in, hidden states out
    prompts = [prompt_ids[index % len(prompt_ids)][: 6 + index] for index in range(4)]
    with daemon.client(direct=False) as client:
        for index, prompt in enumerate(prompts):
            client.append(f"wait-{index}", 1, 0, tokens=prompt[:4])
        before = client.stats().counters
        with stopped(_worker_pid(daemon)):
            outcomes = [in_thread(lambda index=index: daemon.client().append(f"wait-{index}", 1, 4, tokens=prompts[index][4:])) for index in range(4)]
            wait_until(lambda: all(row.in_flight for row in client.stats().sessions), "four appends in flight")
        results = [result(thread, outcome) for thread, outcome in outcomes]
        after = client.stats().counters
    assert after["batched_appends"] - before["batched_appends"] == 4
    assert after["batches"] - before["batches"] <= 2  # the first may have gone alone; the others waited together
    with ShardModel(str(shards[0].path), n_threads=1) as model:
        for index, prompt in enumerate(prompts):
            with model.new_context(N_CTX) as context:
                context.append(0, tokens=np.array(prompt[:4]))
                expected = context.append(4, tokens=np.array(prompt[4:]))
            assert results[index].length == len(prompt)
            assert float(np.abs(results[index].rows - expected).max()) <= PROCESS_MODE_TOLERANCE


def test_cancel_of_one_session_leaves_the_others_appends_whole(daemons, prompt_ids):
    daemon = daemons[0]
    long_prompt = (prompt_ids[0] * 8)[:200]
    with daemon.client(direct=False) as client:
        client.append("keep", 1, 0, tokens=long_prompt[:10])
        client.append("drop", 1, 0, tokens=long_prompt[:10])
        with stopped(_worker_pid(daemon)):
            keep = in_thread(lambda: daemon.client().append("keep", 1, 10, tokens=long_prompt[10:]))
            drop = in_thread(lambda: daemon.client().append("drop", 1, 10, tokens=long_prompt[10:]))
            wait_until(lambda: all(row.in_flight for row in client.stats().sessions), "both appends in flight")
            done = wait_until(lambda: (reply := client.cancel("drop", 1)).detail != "nothing in flight" and reply, "the append to reach the worker")
            assert done.detail == "cancel requested"
        kept = result(*keep)
        error = joined(*drop).get("error")
        assert isinstance(error, KvpoolError) and error.code == "cancelled" and error.length == 10, error
        assert kept.length == len(long_prompt)
        lengths = {row.session_id: row.length for row in client.stats().sessions}
        assert lengths == {"keep": len(long_prompt), "drop": 10}
        # the cancelled session continues from its old length exactly as a session never cancelled
        again = client.append("drop", 1, 10, tokens=long_prompt[10:])
        assert float(np.abs(again.rows - kept.rows).max()) <= PROCESS_MODE_TOLERANCE


def test_release_and_truncate_touch_one_sequence_only(daemons, local_chain, prompt_ids):
    prompt = prompt_ids[1]
    expected = _alone(local_chain, prompt)
    clients = [daemon.client() for daemon in daemons]
    try:
        neighbour = Router(clients).session("neighbour", epoch=1)
        neighbour.append_at(0, prompt_ids[0])
        neighbour.append_at(len(prompt_ids[0]), prompt_ids[0][:5])
        for client in clients:
            assert client.truncate("neighbour", 1, 3) == 3
        tokens, logits = _through(daemons, "target", prompt)
        assert tokens == expected[0] and float(np.abs(logits - expected[1]).max()) <= PROCESS_MODE_TOLERANCE
        for client in clients:
            client.release("neighbour", 1)
            assert {row.session_id for row in client.stats().sessions} == {"target"}
        # a newcomer takes the released sequence: it starts empty, whatever the neighbour had left there
        tokens, logits = _through(daemons, "newcomer", prompt)
        assert tokens == expected[0] and float(np.abs(logits - expected[1]).max()) <= PROCESS_MODE_TOLERANCE
    finally:
        for client in clients:
            client.close()


def test_a_killed_batched_worker_is_worker_lost_for_each_of_its_sessions_and_replaced(shards, socket_dir, prompt_ids):
    daemon = DaemonProcess(shards[0].path, socket_dir / "killed.sock", *BATCHED)
    try:
        with daemon.client(direct=False) as client:
            for index in range(3):
                client.append(f"lost-{index}", 1, 0, tokens=prompt_ids[0][:5])
            pid = _worker_pid(daemon)
            os.kill(pid, signal.SIGKILL)
            for index in range(3):
                with pytest.raises(KvpoolError) as lost:
                    client.append(f"lost-{index}", 1, 5, tokens=prompt_ids[0][5:6])
                assert lost.value.code in ("worker_lost", "cache_miss"), lost.value
            wait_until(lambda: pid not in {row.pid for row in client.stats().workers}, "the worker to be replaced")
            fresh = client.append("after", 1, 0, tokens=prompt_ids[0][:5])
            assert fresh.length == 5
            stats = client.stats()
            assert stats.integrity == "ok" and {row.session_id for row in stats.sessions} == {"after"}
    finally:
        daemon.stop()


def test_a_parked_session_is_restored_exactly_into_a_sequence(daemons, local_chain, prompt_ids):
    prompt = prompt_ids[0]
    expected = _alone(local_chain, prompt)
    clients = [daemon.client() for daemon in daemons]
    try:
        session = Router(clients).session("parked", epoch=1)
        logits = session.append_at(0, prompt)
        assert int(np.argmax(logits[-1])) == expected[0][0]
        for client in clients:
            client.park("parked", 1)
            assert client.stats().sessions[0].tier != "hot"
        logits = session.append_at(len(prompt), [expected[0][0]])
        assert float(np.abs(logits[-1] - expected[1][1]).max()) <= PROCESS_MODE_TOLERANCE
        assert all(client.stats().counters["restores"] == 1 for client in clients)
        # parked again, then restored by a Restore on every daemon at once: a sequence again before the append
        session.route.park("parked", 1)
        restored = session.route.restore("parked", 1)
        assert [(done.detail, done.channel) for done in restored] == [("restored", "")] * 3  # batched workers have no direct channel
        assert all(client.stats().sessions[0].tier == "hot" for client in clients)
        logits = session.append_at(len(prompt) + 1, [expected[0][1]])
        assert float(np.abs(logits[-1] - expected[1][2]).max()) <= PROCESS_MODE_TOLERANCE
        assert all((client.stats().counters["restores"], client.stats().counters["restore_requests"]) == (2, 1) for client in clients)
    finally:
        for client in clients:
            client.close()


# ---- the supervisor's side of one batched worker, driven directly ------------------------------------


def test_cancel_inside_a_shared_batch_rolls_back_that_sequence_only(shards, resource_tracker_running):
    """Two appends in one RunBatch (the worker stopped so the batch waits); cancelling one keeps the
    other's rows; cancelling every one aborts the shared decode."""
    shard = shards[1]  # a middle shard: hidden states in and out
    spec = PoolSpec(
        worker=WorkerSpec(shard_path=str(shard.path), segment=SegmentRegions.for_shard(shard.shape, n_ctx=N_CTX, max_request_bytes=1 << 22),
                          n_threads=1, flash_attn=False, max_n_ctx=N_CTX, seqs_per_worker=2),
        size=1, ready_timeout_s=600, request_timeout_s=600, direct=False,
    )
    rng = np.random.default_rng(3)
    prefix = rng.standard_normal((4, shard.shape.n_embd)).astype(np.float32)
    rows = rng.standard_normal((30, shard.shape.n_embd)).astype(np.float32)

    async def scenario():
        worker = BatchedWorker("test-batched", spec, compute=ComputeSlots(1))
        try:
            await asyncio.to_thread(worker.wait_ready, 600)
            keep, drop = worker.slots
            for slot in worker.slots:
                await slot.open(N_CTX)
                await slot.append(0, prefix)
            with stopped(worker.pid):
                kept = asyncio.ensure_future(keep.append(4, rows))
                dropped = asyncio.ensure_future(drop.append(4, rows))
                await _until(lambda: len(worker._computing) == 2)  # both sent in one RunBatch, waiting in the pipe
                drop.set_abort(True)
            kept_output = await kept
            with pytest.raises(WorkerFailed) as cancelled:
                await dropped
            assert cancelled.value.code == "cancelled" and cancelled.value.length == 4
            assert await drop.truncate(4) == 4 and await keep.truncate(34) == 34
            again = await drop.append(4, rows)  # the same rows on the same prefix as the kept append
            difference = np.abs(np.frombuffer(again.data, np.float32) - np.frombuffer(kept_output.data, np.float32)).max()
            assert float(difference) <= PROCESS_MODE_TOLERANCE
            with stopped(worker.pid):
                both = [asyncio.ensure_future(slot.append(34, rows[:5])) for slot in worker.slots]
                await _until(lambda: len(worker._computing) == 2)
                for slot in worker.slots:
                    slot.set_abort(True)
            for future in both:
                with pytest.raises(WorkerFailed) as aborted:
                    await future
                assert aborted.value.code == "cancelled" and aborted.value.length == 34
            assert [await slot.truncate(34) for slot in worker.slots] == [34, 34]
        finally:
            worker.stop()

    asyncio.run(scenario())


def _fake_batched(directory, seqs: int) -> BatchedWorker:
    """A batched process of `seqs` sequences on a fake worker (tests/support/fake_worker.py): what the batcher
    puts on the pipe, and in which order, in milliseconds and without a model."""
    path = fake_shard_file(directory, 2, 4)  # a middle shard: hidden states in and out
    shape = read_shard_info(path).shape
    spec = PoolSpec(
        worker=WorkerSpec(shard_path=str(path), segment=SegmentRegions.for_shard(shape, n_ctx=N_CTX, max_request_bytes=1 << 20),
                          n_threads=1, flash_attn=False, max_n_ctx=N_CTX, seqs_per_worker=seqs),
        size=1, ready_timeout_s=60, request_timeout_s=60, direct=False, kinds=fake_kinds(),
    )
    return spec.kinds[1]("test-fake-batched", spec, compute=ComputeSlots(1))


def _slow_truncates(worker: BatchedWorker, delay_s: float = 0.05) -> None:
    """Each TruncateContext waits `delay_s` before it takes the pipe, as a slow round trip: a command sent
    meanwhile goes first."""
    call = worker.call

    async def slowed(command):
        if isinstance(command, TruncateContext):
            await asyncio.sleep(delay_s)
        return await call(command)

    worker.call = slowed


async def _cancel_two_of_three(worker: BatchedWorker, rows: np.ndarray) -> list[asyncio.Future]:
    """Three sessions of 10 rows each append 4 more in one RunBatch; the first two are cancelled while it
    computes (not every one: the decode runs on, and those two are rolled back after it)."""
    await asyncio.to_thread(worker.wait_ready, HANG_GUARD_S)
    for slot in worker.slots:
        await slot.open(N_CTX)
        await slot.append(0, rows[:10])
    _slow_truncates(worker)
    with worker.fake_server.stopped():
        appends = [asyncio.ensure_future(slot.append(10, rows[10:])) for slot in worker.slots]
        await _until(lambda: len(worker._computing) == 3)
        worker.slots[0].set_abort(True)
        worker.slots[1].set_abort(True)
    return appends


def test_a_session_cancelled_in_a_shared_batch_is_rolled_back_before_it_is_answered(tmp_path, resource_tracker_running):
    """A session told "cancelled, length 10" may send its next command at once (a park's save): it must find
    its sequence at 10, so every rollback of the batch reaches the worker before any cancelled append is answered."""
    rows = np.random.default_rng(5).standard_normal((14, N_EMBD)).astype(np.float32)

    async def scenario():
        worker = _fake_batched(tmp_path, 3)
        try:
            appends = await _cancel_two_of_three(worker, rows)
            with pytest.raises(WorkerFailed) as cancelled:
                await asyncio.wait_for(appends[1], HANG_GUARD_S)
            assert (cancelled.value.code, cancelled.value.length) == ("cancelled", 10)
            saved = await worker.slots[1].save_state()  # as a park right after the cancelled reply
            assert saved.length == 10
            with pytest.raises(WorkerFailed) as first:
                await appends[0]
            assert (first.value.code, first.value.length) == ("cancelled", 10)
            assert (await appends[2]).length == 14
            await asyncio.wait_for(worker._batcher, HANG_GUARD_S)
            assert [sequence.length for sequence in worker.fake_server.sequences] == [10, 10, 14]
        finally:
            worker.stop()

    asyncio.run(scenario())


def test_a_rollback_never_lands_on_the_session_lent_that_sequence_next(tmp_path, resource_tracker_running):
    """The cancelled session is released at once and its sequence lent to a parked session, restored there at
    14: the cancelled append's rollback (to 10) must have reached the worker before, not truncate the restored one."""
    rows = np.random.default_rng(6).standard_normal((14, N_EMBD)).astype(np.float32)

    async def scenario():
        worker = _fake_batched(tmp_path, 3)
        try:
            appends = await _cancel_two_of_three(worker, rows)
            with pytest.raises(WorkerFailed):
                await asyncio.wait_for(appends[1], HANG_GUARD_S)
            assert (await appends[2]).length == 14
            parked = await worker.slots[2].save_state()
            await worker.slots[1].close_context()
            assert (await worker.slots[1].restore_state(N_CTX, parked.blob, parked.length)).length == 14
            with pytest.raises(WorkerFailed):
                await appends[0]
            await asyncio.wait_for(worker._batcher, HANG_GUARD_S)
            assert (await worker.slots[1].save_state()).length == 14
            assert [sequence.length for sequence in worker.fake_server.sequences] == [10, 14, 14]
        finally:
            worker.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", ["unreadable", "short"])
def test_an_unexpected_error_in_the_batcher_answers_every_append_it_holds(tmp_path, resource_tracker_running, fault):
    """A bug in the batcher (a reply it cannot read; a BatchDone with fewer results than items) must not leave appends
    waiting forever: the batch and the appends queued behind it are answered worker lost, and the process counts as
    lost (replaced)."""
    rows = np.random.default_rng(7).standard_normal((3, N_EMBD)).astype(np.float32)

    async def scenario():
        worker = _fake_batched(tmp_path, 2)
        try:
            await asyncio.to_thread(worker.wait_ready, HANG_GUARD_S)
            for slot in worker.slots:
                await slot.open(N_CTX)
            call = worker.call

            async def unreadable(command):
                reply = await call(command)
                if isinstance(command, RunBatch):
                    if fault == "short":
                        return BatchDone(results=reply.results[:-1])
                    raise ValueError("a reply the batcher cannot read")
                return reply

            worker.call = unreadable
            with worker.fake_server.stopped():
                computing = asyncio.ensure_future(worker.slots[0].append(0, rows))
                await _until(lambda: len(worker._computing) == 1)
                queued = asyncio.ensure_future(worker.slots[1].append(0, rows))
                await _until(lambda: len(worker._queue) == 1)
            for append in (computing, queued):
                with pytest.raises(WorkerLost, match="the batcher failed"):
                    await asyncio.wait_for(append, HANG_GUARD_S)
            assert worker.lost
        finally:
            worker.stop()

    asyncio.run(scenario())


def test_stopping_a_batched_process_under_a_call_in_flight_ends_that_call(shards, resource_tracker_running):
    """The pool replaces a dead process when any of its slots is replaced, maybe while another slot's batch
    waits on the pipe: the waiting call must end (worker lost) rather than wait on a closed pipe forever."""
    shard = shards[1]
    spec = PoolSpec(
        worker=WorkerSpec(shard_path=str(shard.path), segment=SegmentRegions.for_shard(shard.shape, n_ctx=N_CTX, max_request_bytes=1 << 22),
                          n_threads=1, flash_attn=False, max_n_ctx=N_CTX, seqs_per_worker=2),
        size=1, ready_timeout_s=600, request_timeout_s=3600, direct=False,
    )
    rows = np.random.default_rng(4).standard_normal((3, shard.shape.n_embd)).astype(np.float32)

    async def scenario():
        worker = BatchedWorker("test-stop", spec, compute=compute)
        try:
            await asyncio.to_thread(worker.wait_ready, 600)
            slot = worker.slots[0]
            await slot.open(N_CTX)
            os.kill(worker.pid, signal.SIGSTOP)  # the batch waits on the pipe: a call in flight
            in_flight = asyncio.ensure_future(slot.append(0, rows))
            await _until(lambda: len(worker._computing) == 1)
            # As pool.start_replacement does, in a thread; the loop is held meanwhile, so it cannot see the
            # worker's end of the pipe close before stop() closes ours (the race the fix is for).
            stopper = threading.Thread(target=worker.stop, args=(5.0,))
            stopper.start()
            stopper.join()
            with pytest.raises(WorkerLost):
                await asyncio.wait_for(in_flight, HANG_GUARD_S)
            # the batcher's own call ends too, and gives its compute slot back (the daemon's other processes wait on it)
            await asyncio.wait_for(worker._batcher, HANG_GUARD_S)
            await asyncio.wait_for(compute.slot().__aenter__(), HANG_GUARD_S)
        finally:
            worker.stop()

    compute = ComputeSlots(1)
    asyncio.run(scenario())


async def _until(predicate) -> None:
    for _ in range(int(HANG_GUARD_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("hang guard")


def test_mode_auto_measures_both_schedules_and_says_which_it_runs(shards, socket_dir, prompt_ids):
    daemon = DaemonProcess(shards[1].path, socket_dir / "auto.sock", "--mode", "auto", "--seqs-per-worker", "4", "--max-sessions", "4", "--threads", "1", "--n-ctx", str(N_CTX))
    try:
        with daemon.client() as client:
            stats = client.stats()
            assert stats.mode in ("process", "batched")
            assert stats.mode_detail.startswith(f"--mode auto picked {stats.mode}: measured at start-up, batched ")
            assert f"--mode {stats.mode}:" in stats.mode_detail
            hidden = np.random.default_rng(1).standard_normal((5, shards[1].shape.n_embd)).astype(np.float32)
            reply = client.append("auto", 1, 0, hidden=hidden)
            assert reply.length == 5 and reply.rows.shape == (5, shards[1].shape.n_embd)
        assert f"--mode auto picked {stats.mode}" in daemon.log()
    finally:
        daemon.stop()

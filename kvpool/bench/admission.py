"""Sections 5 and 6 on the whole-model daemon: admission, release, reclaim and LRU eviction against bare
llama contexts; memory charged and measured against the theoretical KV size."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time

import numpy as np

from kvpool.bench.options import EPOCH, SESSIONS, SINGLE_THREADS, bench_say
from kvpool.bench.reference import PlainContext
from kvpool.bench.rig import Rig, daemon_uss, time_call
from kvpool.client.client import Client
from workers.runtime.model import ShardModel

# ---- sections 5 and 6: admission, reclaim, memory (whole-model daemon) --------------------------------


def measure_admission(rig: Rig) -> dict:
    client = rig.client("whole")
    token = rig.prompts[0][:1]
    results: dict[str, dict] = {"first_admit_s": {}, "admit_s": {}, "release_s": {}, "reclaim_visible_s": {}, "admits_into_spare": {},
                                "uss_kept_bytes": {}, "bare_create_s": {}, "bare_free_s": {}, "inprocess_admit_s": {},
                                "create_admit_s": {}, "creates_into_spare": {}, "creates_freeing_a_spare": {}}
    counter = iter(range(10**9))

    def admit(n_ctx: int) -> tuple[str, float]:
        session = f"bench-admit-{next(counter)}"
        elapsed = time_call(lambda: client.append(session, EPOCH, 0, tokens=token, n_ctx=n_ctx))
        return session, elapsed

    calibrated_at_start = rig.options.max_n_ctx
    reference_pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        _measure_admissions(rig, client, admit, token, reference_pool, results, calibrated_at_start)
    finally:
        reference_pool.shutdown()
    return _measure_eviction(rig, client, admit, token, results)


def _admission_reference(model_path: str, n_ctx: int, token: list[int], repeats: int) -> tuple[list[float], list[float], list[float]]:
    """In a fresh process: bare llama context create and free, and the worker runtime's create + 1-token append."""
    create, free, inprocess = [], [], []
    with ShardModel(model_path, n_threads=SINGLE_THREADS) as model:
        for _ in range(repeats):
            started = time.perf_counter()
            plain = PlainContext(model, n_ctx, n_threads=SINGLE_THREADS)
            create.append(time.perf_counter() - started)
            free.append(time_call(plain.close))
            started = time.perf_counter()
            context = model.new_context(n_ctx)
            context.append(0, tokens=np.asarray(token, dtype=np.int32))
            inprocess.append(time.perf_counter() - started)
            context.close()
    return create, free, inprocess


def _measure_admissions(rig: Rig, client: Client, admit, token: list[int], reference_pool, results: dict, calibrated_at_start: int) -> None:
    options = rig.options
    for n_ctx in options.admit_n_ctx:
        session, first = admit(n_ctx)
        client.release(session, EPOCH)
        results["first_admit_s"][n_ctx] = None if n_ctx == calibrated_at_start else first
        admits, releases, visible, kept = [], [], [], []
        into_spare = client.stats().counters.get("admissions_into_spare", 0)
        for _ in range(options.repeats):
            before_stats = client.stats()
            before = before_stats.budget.reserved_bytes
            session, elapsed = admit(n_ctx)
            admits.append(elapsed)
            started = time.perf_counter()
            client.release(session, EPOCH)
            releases.append(time.perf_counter() - started)
            while True:
                stats = client.stats()
                if stats.budget.reserved_bytes == before:
                    break
            visible.append(time.perf_counter() - started)
            kept.append(stats.budget.measured_uss_bytes - before_stats.budget.measured_uss_bytes)
        results["admit_s"][n_ctx] = admits
        results["admits_into_spare"][n_ctx] = client.stats().counters.get("admissions_into_spare", 0) - into_spare  # the release before left its context
        results["release_s"][n_ctx] = releases
        results["reclaim_visible_s"][n_ctx] = visible
        results["uss_kept_bytes"][n_ctx] = kept
        # in-process references, in a process of their own (as clean as a worker: the bench process's own
        # allocator holds memory freed by earlier sections, which would make its context creation look cheap)
        create, free, inprocess = reference_pool.submit(_admission_reference, str(options.model), n_ctx, token, options.repeats).result()
        results["bare_create_s"][n_ctx] = create
        results["bare_free_s"][n_ctx] = free
        results["inprocess_admit_s"][n_ctx] = inprocess
        bench_say(f"admission: n_ctx {n_ctx} done")
    # admissions that create their context, as a daemon serving many sizes has them (after every first admission
    # above, which they would otherwise leave a worker's spare to free): each of an n_ctx no spare holds (n_ctx - 1,
    # n_ctx - 2, ...: the same KV to a cell or two), on a worker without a spare, or, where every free worker holds
    # one of another size, on one that frees it first, inside the admitting append (counted)
    for n_ctx in options.admit_n_ctx:
        into_spare = client.stats().counters.get("admissions_into_spare", 0)
        creates, replacing = [], 0
        for step in range(1, options.repeats + 1):
            replacing += all(worker.spare_bytes for worker in client.stats().workers if worker.state == "free")
            session, elapsed = admit(n_ctx - step)
            creates.append(elapsed)
            client.release(session, EPOCH)
        results["create_admit_s"][n_ctx] = creates
        results["creates_into_spare"][n_ctx] = client.stats().counters.get("admissions_into_spare", 0) - into_spare  # 0 expected
        results["creates_freeing_a_spare"][n_ctx] = replacing
    bench_say("admission: admissions that create their context done")


def _measure_eviction(rig: Rig, client: Client, admit, token: list[int], results: dict) -> dict:
    options = rig.options
    # a 1-token decode through the daemon, to take the compute out of the admitting append
    session, _ = admit(2048)
    decode = [time_call(lambda position=position: client.append(session, EPOCH, position, tokens=token)) for position in range(1, 1 + max(16, options.repeats * 4))]
    client.release(session, EPOCH)
    results["decode_s"] = decode

    # LRU eviction: every worker bound to an idle session, then each new admission takes the oldest one's
    # worker; with the warm tier on (the daemon's default) the victim is parked (a spill), else dropped
    live = [admit(2048)[0] for _ in range(SESSIONS)]
    counters_before = client.stats().counters
    evict = []
    for _ in range(options.repeats):
        session, elapsed = admit(2048)
        evict.append(elapsed)
        live.append(session)
    counters = client.stats().counters
    dropped, parked = (counters.get(name, 0) - counters_before.get(name, 0) for name in ("evictions", "spills"))
    for session in live:
        client.release(session, EPOCH)
    results["evict_admit_s"] = evict
    results["evictions_counted"] = dropped + parked
    results["evicted_victims_parked"] = parked
    bench_say("admission: LRU eviction done")
    return results


def measure_memory(rig: Rig) -> dict:
    client = rig.client("whole")
    daemon = rig.daemons["whole"]
    prompt = rig.prompts[1]
    per_position = rig.whole_model.kv_bytes_per_position()
    per_session = {}
    for n_ctx in rig.options.admit_n_ctx:
        workers_before = client.stats().workers
        before = {worker.pid: worker.uss_bytes for worker in workers_before}
        baseline = {worker.pid: worker.baseline_uss_bytes for worker in workers_before}
        session = f"bench-memory-{n_ctx}"
        client.append(session, EPOCH, 0, tokens=prompt, n_ctx=n_ctx)
        stats = client.stats()
        row = next(row for row in stats.sessions if row.session_id == session)
        after = next(worker.uss_bytes for worker in stats.workers if worker.pid == row.worker_pid)
        per_session[n_ctx] = {
            "charged_bytes": row.charged_bytes,
            "theoretical_kv_bytes": n_ctx * per_position,
            # what the worker holds serving it over its start-up USS: its context may be a spare that worker already
            # held (a released session's, kvpool.daemon.books), so the growth since just before would miss it
            "uss_growth_bytes": after - baseline[row.worker_pid],
            # memory the worker already held above its start-up USS (a spare context, or memory freed by earlier
            # contexts and kept by the allocator)
            "held_before_bytes": before[row.worker_pid] - baseline[row.worker_pid],
        }
        client.release(session, EPOCH)
    daemon_totals = {0: rig.daemon_uss_at_start}  # not now: the sessions released above left their contexts as spares
    sessions = []
    for count in range(1, SESSIONS + 1):
        session = f"bench-memory-live-{count}"
        client.append(session, EPOCH, 0, tokens=prompt, n_ctx=2048)
        sessions.append(session)
        if count in (1, SESSIONS):
            daemon_totals[count] = daemon_uss(daemon)
    for session in sessions:
        client.release(session, EPOCH)
    bench_say("memory done")
    return {
        "kv_bytes_per_position": per_position,
        "per_session": per_session,
        "daemon_uss_bytes": daemon_totals,
        "daemon_uss_at_start_bytes": rig.daemon_uss_at_start,
        "daemon_sessions_n_ctx": 2048,
    }

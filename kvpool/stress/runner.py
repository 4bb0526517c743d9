"""The run: run_stress and its helpers (prompts, chain, sessions, replays, summaries)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from kvpool.client.client import Client
from kvpool.host import format_bytes
from kvpool.launcher import start_daemons
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import shards_in_parts
from kvpool.stress.checks import DrillFacts, build_verdicts, daemon_summaries, settle_daemons, take_snapshot
from kvpool.stress.daemons import Chain, open_chain, serve_options, stop_all
from kvpool.stress.driver import SessionDriver
from kvpool.stress.faults import resume_stalled
from kvpool.stress.log import DaemonReference, LocalReference, ReplayOutcome, replay_alone
from kvpool.stress.options import UNLIMITED_BUDGET, StressOptions
from kvpool.stress.plans import SessionSetup, build_plans
from kvpool.stress.prefixes import SharedPrompt, shared_prompts
from kvpool.stress.processes import Footprint
from kvpool.stress.recording import Recorder, Sampler
from kvpool.stress.replans import SessionReplans, open_replan_chain
from kvpool.stress.report import SessionSummary, StressReport
from kvpool.stress.restarts import ChainControl, RollingRestart
from kvpool.stress.slow_reader import SlowReader

FILLER_ROWS = 192  # rows of the long prefill that gets cancelled
PROGRESS_EVERY_S = 2.0

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea, the wind and a lighthouse keeper who counts the waves at night.",
    "List four fruits.",
    "Why is the sky blue? Answer briefly.",
    "Explain what a hash table is to a ten year old.",
    "Give three tips for writing clear commit messages.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Describe the water cycle in two sentences.",
)
FILLER_TEXT = " ".join(f"The lighthouse log entry number {i} says the sea was calm and the lamp was bright." for i in range(40))


# ---- the run --------------------------------------------------------------------------------------------


Say = Callable[[str], None]


def say_on_stderr(message: str) -> None:
    print(f"kvpool stress: {message}", file=sys.stderr, flush=True)


def _prompts(tokenizer: Tokenizer, options: StressOptions) -> list[SharedPrompt]:
    if options.shared_prefix:
        return shared_prompts(tokenizer, options.sessions, options.seed, options.prefix_block)
    prompts = []
    for index in range(options.sessions):
        text = PROMPTS[index % len(PROMPTS)] + (f" (variant {index // len(PROMPTS)})" if index >= len(PROMPTS) else "")
        prompts.append(SharedPrompt(tuple(tokenizer.encode(tokenizer.chat_prompt(text))), "", 0))
    return prompts


def _shard_paths_of(sockets: Sequence[pathlib.Path]) -> list[pathlib.Path]:
    paths = []
    for path in sockets:
        with Client(path, timeout_s=30, name="stress-attach") as client:
            paths.append(pathlib.Path(client.shard.model_path))
    return paths


def _progress_loop(stop: threading.Event, recorder: Recorder, sampler: Sampler, total_ops: int, started: float, say: Say) -> None:
    while not stop.wait(PROGRESS_EVERY_S):
        latest = sampler.latest()
        reserved = " ".join(f"d{index}={format_bytes(sample.reserved_bytes)}" for index, sample in sorted(latest.items()))
        errors = ", ".join(f"{key} {count}" for key, count in recorder.error_counts().items()) or "none"
        say(f"{time.monotonic() - started:6.1f} s  ops {recorder.ops_done}/{total_ops}  reserved {reserved}  replies with errors: {errors}")


def _run_sessions(
    options: StressOptions, chain: Chain, setups: Sequence[SessionSetup], recorder: Recorder, sampler: Sampler, say: Say, control: ChainControl | None,
    second: Chain | None, rolling: RollingRestart | None = None,
) -> tuple[list[SessionDriver], float]:
    """The drivers once every session is done, and when they started (monotonic); `rolling` drains the
    daemons in turn meanwhile (--restart)."""
    drivers: list[SessionDriver] = []
    try:
        for setup in setups:
            clients: list[Client] = []
            try:
                for path in chain.sockets:
                    clients.append(Client(path, name=setup.session_id))
            except BaseException:
                for client in clients:
                    client.close()
                raise
            drivers.append(SessionDriver(setup, clients, options, recorder, control))
            if second is not None:
                drivers[-1].replans = SessionReplans(second, setup.session_id, options.ops)
        for driver in drivers:
            if driver.setup.follows is not None:
                driver.follows = drivers[driver.setup.follows]
        threads = [threading.Thread(target=driver.run, name=driver.session_id, daemon=True) for driver in drivers]
        stop = threading.Event()
        progress = threading.Thread(
            target=_progress_loop, args=(stop, recorder, sampler, options.sessions * options.ops, time.monotonic(), say), daemon=True
        )
        progress.start()
        started = time.monotonic()
        for thread in threads:
            thread.start()
        if rolling is not None:
            rolling.start()
        for thread in threads:
            thread.join()
        if rolling is not None:
            rolling.stop()
        stop.set()
        progress.join()
    finally:
        for driver in drivers:  # a session replaces its client of a restarted daemon
            for client in driver.first_clients:
                client.close()
            if driver.replans is not None:
                driver.replans.close()
    return drivers, started


def _replay_all(options: StressOptions, chain: Chain, drivers: Sequence[SessionDriver], socket_dir: pathlib.Path, say: Say) -> list[ReplayOutcome]:
    if options.reference == "local":
        say("replaying each session alone in process (LocalChain)")
        local = LocalReference(chain.shard_paths, options.n_ctx)
        try:
            return [replay_alone(driver.log, local, driver.session_id) for driver in drivers]
        finally:
            local.close()
    serve = serve_options(options, max_sessions=1, budget=UNLIMITED_BUDGET, ttl_s=3600)
    say(f"replaying each session alone on a fresh chain of {len(chain.shard_paths)} daemons ({' '.join(serve)})")
    daemons = start_daemons(chain.shard_paths, socket_dir, serve, prefix="reference")
    try:
        clients = [daemon.client() for daemon in daemons]
        try:
            reference = DaemonReference(clients)
            return [replay_alone(driver.log, reference, driver.session_id) for driver in drivers]
        finally:
            for client in clients:
                client.close()
    finally:
        stop_all(daemons)


def _session_summary(driver: SessionDriver, replay: ReplayOutcome, started: float) -> SessionSummary:
    diff: float | None = None
    counts = driver.session.counts
    mismatches = list(replay.mismatches)
    if driver.logits is not None and replay.final_row is not None and not driver.violations:
        diff = float(np.abs(driver.logits - replay.final_row).max())
        if diff != 0.0:
            mismatches.append(f"{driver.session_id}: final logits differ from the run alone (max |diff| {diff:g})")
    return SessionSummary(
        session_id=driver.session_id, prompt_tokens=len(driver.setup.prompt), ops=dict(sorted(driver.ops.items())),
        appends=driver.appends, resets=driver.resets, recoveries=driver.recoveries, misses=dict(driver.misses),
        cancels_landed=driver.cancels_landed, cancels_completed=driver.cancels_completed,
        final_epoch=driver.epoch, final_length=driver.final_length, generated=driver.tokens[len(driver.setup.prompt) :],
        checked_rows=replay.checked_rows, greedy_checked=replay.greedy_checked, final_logits_max_abs_diff=diff,
        mismatches=mismatches, violations=driver.violations, unexercised=driver.unexercised(),
        late_cancels=driver.late_cancels, cancels_landed_on=dict(sorted(driver.cancels_landed_on.items())),
        cancel_attempts_missed=driver.cancel_attempts_missed, cancel_targets_missed=driver.schedule.cancel_targets_missed, connection_losses=driver.connection_losses,
        release_reconnects=driver.release_reconnects, failed_op=driver.failed_op,
        completed_s=round(driver.finished_at - started, 3) if driver.finished_at is not None else None,
        admissions=len(driver.admission_waits), max_admission_wait_s=round(max(driver.admission_waits, default=0.0), 3),
        full_replays=driver.full_replays, full_replayed_tokens=counts.replayed_tokens, tail_replays=counts.tail_replays,
        tail_replayed_tokens=counts.tail_replayed_tokens, position_mismatches=counts.position_mismatches, restores=driver.restores,
        prompt_kind=driver.setup.prompt_kind, shared_tokens=driver.setup.shared_tokens, prefix_hits=counts.prefix_hits,
        prefix_hit_tokens=counts.prefix_hit_tokens, prefix_fallbacks=counts.prefix_fallbacks, prefix_starts=list(driver.prefix_starts),
    )


def run_stress(options: StressOptions, *, say: Say = say_on_stderr) -> StressReport:
    """The whole run: set up, drive the sessions, check, replay alone, judge. Raises on setup failure."""
    started = time.monotonic()
    run_prefix = f"stress-{os.getpid()}-{options.seed}-"
    socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-stress-", dir="/tmp"))
    keep_logs = False
    try:
        if options.sockets:
            shard_paths = _shard_paths_of(options.sockets)
        else:
            source = options.model or bundled_model_path()
            shard_paths = [shard.path for shard in shards_in_parts(source, options.parts, progress=say)]
        with Tokenizer(shard_paths[0]) as tokenizer:
            prompts = _prompts(tokenizer, options)
            filler = tuple(tokenizer.encode(FILLER_TEXT, add_special=False)[:FILLER_ROWS])
        plans = build_plans(options, len(shard_paths))
        chain = open_chain(options, socket_dir, prompts[0].tokens, say, shard_paths, plans)
        footprint = Footprint()
        drills = DrillFacts()
        second: Chain | None = None
        try:
            if options.replan:
                second = open_replan_chain(source, options.second_parts, socket_dir, chain.serve_options[0], chain.workers_expected, say)
                footprint.add(second.daemons)
                before_second = take_snapshot(second.sockets)
            setups = [
                SessionSetup(i, f"{run_prefix}{i}", prompts[i].tokens, filler, plans[i], prompts[i].kind, prompts[i].shared_tokens, prompts[i].follows)
                for i in range(options.sessions)
            ]
            if options.shared_prefix:
                say(f"prompts sharing prefixes (--prefix-block {options.prefix_block}): "
                    + ", ".join(f"{len(p.tokens)} tokens ({p.kind}, shares {p.shared_tokens})" for p in prompts))
            control = ChainControl(chain, say) if options.kill_supervisor or options.restart else None
            footprint.add(chain.daemons)
            before = take_snapshot(chain.sockets)
            recorder = Recorder()
            sampler = Sampler(chain.sockets, options.sample_interval_s, expected_loss=control.restarted if control is not None else None)
            slow = SlowReader(chain.sockets[-1], len(chain.sockets) - 1, f"{run_prefix}slow-reader", options.n_ctx, options.seed) if options.slow_reader else None
            sampler.start()
            say(f"{options.sessions} sessions x {options.ops} ops, scenario {options.scenario}, seed {options.seed}")
            try:
                if slow is not None:
                    slow.start()
                    say(f"slow reader: {slow.record.appends_planned} appends to daemon {slow.record.daemon} on a connection that never reads")
                rolling = RollingRestart(control, recorder, len(chain.sockets), options.sessions * options.ops) if control is not None and options.restart else None
                drivers, sessions_started = _run_sessions(options, chain, setups, recorder, sampler, say, control, second, rolling)
                if rolling is not None:
                    drills.restart_error = rolling.error
                if slow is not None:
                    drills.slow_reader = slow.finish()
            finally:
                if slow is not None:
                    slow.close()
                sampler.stop()
            drills.stalls = [driver.faults.stall for driver in drivers if driver.faults.stall is not None]
            resume_stalled(drills.stalls)
            drills.supervisor_kills = control.kills if control is not None else []
            drills.restarts = control.restarts if control is not None else []
            drills.sampler_gaps = sampler.gaps
            say(f"sessions done in {time.monotonic() - started:.1f} s; waiting for the daemons to settle")
            after = settle_daemons(chain.sockets, before, run_prefix, options.uss_tolerance_bytes, chain.workers_expected)
            footprint.add(chain.daemons)
            if second is not None:
                after_second = settle_daemons(second.sockets, before_second, run_prefix, options.uss_tolerance_bytes, second.workers_expected)
                drills.second_chain = daemon_summaries(second, before_second, after_second, [], options.uss_tolerance_bytes, run_prefix)
        finally:
            codes = stop_all(chain.daemons) + (stop_all(second.daemons) if second is not None else [])
            if chain.daemons and any(codes):
                keep_logs = True
                say(f"daemon exit codes {codes}: logs kept in {socket_dir}")
        if chain.daemons:
            drills.leftover_pids, drills.leftover_segments = footprint.leftovers()
        replays = _replay_all(options, chain, drivers, socket_dir, say)
        sessions = [_session_summary(driver, replay, sessions_started) for driver, replay in zip(drivers, replays)]
        restarted = frozenset(kill.daemon for kill in drills.supervisor_kills) | frozenset(restart.daemon for restart in drills.restarts)
        daemons = daemon_summaries(chain, before, after, sampler.samples, options.uss_tolerance_bytes, run_prefix, restarted)
        verdicts, warnings = build_verdicts(options, chain, drivers, sessions, daemons, sampler.samples, sampler.failures, drills)
        ops_by_kind = Counter()
        for driver in drivers:
            ops_by_kind.update(driver.ops)
        report = StressReport(
            scenario=options.scenario,
            options={field.name: _plain(getattr(options, field.name)) for field in dataclasses.fields(options)},
            reference="fresh daemons" if options.reference == "daemon" else "in-process LocalChain",
            duration_s=round(time.monotonic() - started, 3),
            ops_by_kind=dict(sorted(ops_by_kind.items())), latency_ms=recorder.latency_summary(),
            errors_by_code=recorder.error_counts(), events=recorder.event_counts(),
            uss_tolerance_bytes=options.uss_tolerance_bytes, samples=sampler.samples, sessions=sessions, daemons=daemons,
            kills=[driver.faults.kill for driver in drivers if driver.faults.kill is not None], verdicts=verdicts,
            passed=all(verdict.passed for verdict in verdicts), warnings=warnings, stalls=drills.stalls,
            supervisor_kills=drills.supervisor_kills, slow_reader=drills.slow_reader, restarts=drills.restarts,
            replans=[record for driver in drivers if driver.replans is not None for record in driver.replans.records],
        )
        keep_logs = keep_logs or not report.passed
        if options.json_path is not None:
            options.json_path.parent.mkdir(parents=True, exist_ok=True)
            options.json_path.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
        return report
    except BaseException:
        keep_logs = True
        raise
    finally:
        if keep_logs and any(socket_dir.glob("*.log")):
            say(f"daemon logs kept in {socket_dir}")
        else:
            shutil.rmtree(socket_dir, ignore_errors=True)


def _plain(value: object) -> object:
    if isinstance(value, pathlib.Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value

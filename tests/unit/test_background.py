"""Work no caller waits for (workers.server.background): run in a thread of its own whose nice value is BACKGROUND_NICE
above the caller's (at most 19), the caller's own left as it was; its result and its errors come back to run()."""

from __future__ import annotations

import os
import threading

import pytest

from kvpool.daemon.config import ServeConfig
from workers.server.background import BACKGROUND_NICE, Background, in_this_thread, lower_this_thread


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _where() -> tuple[int, int]:
    return threading.get_native_id(), _nice()


def _background_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("kvpool-background")]


def test_the_work_runs_in_one_thread_of_its_own_started_with_it_at_a_lower_priority_and_the_caller_keeps_its_own():
    before = len(_background_threads())
    background = Background()
    caller = _nice()
    try:
        assert len(_background_threads()) == before + 1  # started before any work: the worker reports ready after
        first, second = background.run(_where), background.run(_where)
    finally:
        background.close()
    assert len(_background_threads()) == before
    assert first == second  # one thread, kept
    assert first[0] != threading.get_native_id() and first[1] == min(19, caller + BACKGROUND_NICE)
    assert _nice() == caller
    assert in_this_thread(_where) == (threading.get_native_id(), caller)  # the counterpart for work a caller waits for


def test_its_errors_come_back_and_it_runs_again_after_close():
    background = Background()
    try:
        with pytest.raises(ZeroDivisionError):
            background.run(lambda: 1 / 0)
        assert background.run(lambda a, b: a + b, 2, 3) == 5
        background.close()
        assert background.run(lambda: 7) == 7
    finally:
        background.close()


def test_a_thread_already_nice_goes_no_further_than_19():
    def nice_then_lowered() -> tuple[int, int]:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, 15)
        lower_this_thread()
        after = _nice()
        lower_this_thread()
        return after, _nice()

    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(nice_then_lowered()))
    thread.start()
    thread.join()
    assert outcome == [(19, 19)]


def test_the_flag_takes_0_to_19_and_reaches_every_workers_spec(serve, fake_model):
    assert ServeConfig(model="m", socket="/tmp/s").background_nice == BACKGROUND_NICE  # the default
    for edge in (0, 19):
        assert ServeConfig(model="m", socket="/tmp/s", background_nice=edge).background_nice == edge
    for wrong in (-1, 20):
        with pytest.raises(ValueError, match=r"--background-nice must be in \[0, 19\]"):
            ServeConfig(model="m", socket="/tmp/s", background_nice=wrong)
    daemon = serve(fake_model, "--background-nice", "3")
    assert daemon.supervisor.service.pool.spec.worker.background_nice == 3

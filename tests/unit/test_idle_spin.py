"""workers.server.spin: how long llama.cpp's idle OpenMP threads spin in a worker (GOMP_SPINCOUNT), set before
llama.cpp loads, the user's own setting kept; --idle-spin's edges."""

from __future__ import annotations

import pytest

from kvpool.daemon.config import ServeConfig
from kvpool.daemon.status import threads_detail
from workers.server.spin import DEFAULT_IDLE_SPIN, ENVIRONMENT_KEPT, SPIN_COUNT, WAIT_POLICY, check_idle_spin, set_idle_spin

NOT_LOADED: frozenset[str] = frozenset()


def test_the_count_is_set_where_the_environment_says_nothing():
    environ: dict[str, str] = {"PATH": "/bin"}
    assert set_idle_spin(DEFAULT_IDLE_SPIN, environ, NOT_LOADED) == f"{DEFAULT_IDLE_SPIN} times before they sleep (GOMP_SPINCOUNT={DEFAULT_IDLE_SPIN})"
    assert environ == {"PATH": "/bin", SPIN_COUNT: str(DEFAULT_IDLE_SPIN)}
    environ = {}
    assert set_idle_spin(0, environ, NOT_LOADED) == "0 times before they sleep (GOMP_SPINCOUNT=0)"  # the edge: sleep at once
    assert environ == {SPIN_COUNT: "0"}


@pytest.mark.parametrize("given", [{SPIN_COUNT: "777"}, {WAIT_POLICY: "passive"}, {SPIN_COUNT: "5", WAIT_POLICY: "active"}])
def test_a_setting_the_process_was_started_with_is_kept(given):
    environ = dict(given)
    said = set_idle_spin(DEFAULT_IDLE_SPIN, environ, NOT_LOADED)
    assert environ == given
    assert said == f"{ENVIRONMENT_KEPT} (" + " ".join(f"{name}={value}" for name, value in given.items()) + "; --idle-spin not applied)"


def test_once_llama_cpp_is_loaded_nothing_is_set_and_that_is_said():
    environ: dict[str, str] = {}
    said = set_idle_spin(DEFAULT_IDLE_SPIN, environ, frozenset({"llama_cpp"}))
    assert environ == {}
    assert "not set: llama.cpp was loaded first" in said


def test_a_negative_count_is_refused_and_sets_nothing():
    environ: dict[str, str] = {}
    with pytest.raises(ValueError, match=r"--idle-spin must be >= 0 \(got -1\)"):
        set_idle_spin(-1, environ, NOT_LOADED)
    assert environ == {}
    assert check_idle_spin(0) == 0


def test_the_flag_takes_0_and_up_and_reaches_every_workers_spec(serve, fake_model):
    assert ServeConfig(model="m", socket="/tmp/s").idle_spin == DEFAULT_IDLE_SPIN  # the default
    assert ServeConfig(model="m", socket="/tmp/s", idle_spin=0).idle_spin == 0
    with pytest.raises(ValueError, match=r"--idle-spin must be >= 0 \(got -1\)"):
        ServeConfig(model="m", socket="/tmp/s", idle_spin=-1)
    daemon = serve(fake_model, "--idle-spin", "2500")
    assert daemon.supervisor.service.pool.spec.worker.idle_spin == 2500


def test_the_status_line_says_nothing_spins_at_one_thread_and_what_applies_above():
    assert threads_detail(1, "10000 times before they sleep (GOMP_SPINCOUNT=10000)") == (
        "1 llama thread a worker: no OpenMP team, nothing spins idle (--idle-spin has no effect)")
    assert threads_detail(2, "10000 times before they sleep (GOMP_SPINCOUNT=10000)") == (
        "2 llama threads a worker; idle threads spin 10000 times before they sleep (GOMP_SPINCOUNT=10000)")
    assert threads_detail(4, "") == "4 llama threads a worker; idle threads spin n/a (not reported)"

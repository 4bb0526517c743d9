"""workers.server.spin: how long llama.cpp's idle OpenMP threads spin in a worker (GOMP_SPINCOUNT), set before
llama.cpp loads, the user's own setting kept; --idle-spin's edges."""

from __future__ import annotations

import pytest

from kvpool.daemon.config import ServeConfig
from workers.server.spin import DEFAULT_IDLE_SPIN, SPIN_COUNT, WAIT_POLICY, set_idle_spin

NOT_LOADED: frozenset[str] = frozenset()


def test_the_count_is_set_where_the_environment_says_nothing():
    environ: dict[str, str] = {"PATH": "/bin"}
    assert set_idle_spin(DEFAULT_IDLE_SPIN, environ, NOT_LOADED) == f"GOMP_SPINCOUNT={DEFAULT_IDLE_SPIN}"
    assert environ == {"PATH": "/bin", SPIN_COUNT: str(DEFAULT_IDLE_SPIN)}
    environ = {}
    assert set_idle_spin(0, environ, NOT_LOADED) == "GOMP_SPINCOUNT=0"  # the edge: sleep at once
    assert environ == {SPIN_COUNT: "0"}


@pytest.mark.parametrize("given", [{SPIN_COUNT: "777"}, {WAIT_POLICY: "passive"}, {SPIN_COUNT: "5", WAIT_POLICY: "active"}])
def test_a_setting_the_process_was_started_with_is_kept(given):
    environ = dict(given)
    said = set_idle_spin(DEFAULT_IDLE_SPIN, environ, NOT_LOADED)
    assert environ == given
    assert said == "from the environment: " + " ".join(f"{name}={value}" for name, value in given.items())


def test_once_llama_cpp_is_loaded_nothing_is_set_and_that_is_said():
    environ: dict[str, str] = {}
    said = set_idle_spin(DEFAULT_IDLE_SPIN, environ, frozenset({"llama_cpp"}))
    assert environ == {}
    assert "not set: llama.cpp was loaded first" in said


def test_a_negative_count_is_refused_and_sets_nothing():
    environ: dict[str, str] = {}
    with pytest.raises(ValueError, match="idle spin must be >= 0"):
        set_idle_spin(-1, environ, NOT_LOADED)
    assert environ == {}


def test_the_flag_takes_0_and_up_and_reaches_every_workers_spec(serve, fake_model):
    assert ServeConfig(model="m", socket="/tmp/s").idle_spin == DEFAULT_IDLE_SPIN  # the default
    assert ServeConfig(model="m", socket="/tmp/s", idle_spin=0).idle_spin == 0
    with pytest.raises(ValueError, match=r"--idle-spin must be >= 0"):
        ServeConfig(model="m", socket="/tmp/s", idle_spin=-1)
    daemon = serve(fake_model, "--idle-spin", "2500")
    assert daemon.supervisor.service.pool.spec.worker.idle_spin == 2500

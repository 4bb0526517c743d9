"""The start-up probe's readings kept between runs (kvpool.daemon.admission.probe_cache), on fake workers: a
daemon started again with the same key takes its charges from them without probing, one with another key (or
with the cache off) probes, and a damaged file is measured again and replaced."""

from __future__ import annotations

import pathlib

import pytest

from kvpool.daemon.config import ServeConfig
from kvpool.host import user_cache_dir
from tests.support.contract import MODES, mode_flags
from tests.support.fake_daemon import started


@pytest.mark.parametrize("mode", MODES)
def test_a_second_start_takes_the_kept_readings_and_charges_the_same(serve, fake_model, tmp_path, mode):
    cache = tmp_path / "calibration"
    first, _ = started(serve, fake_model, *mode_flags(mode), "--calibration-cache", str(cache))
    assert (first.counters["calibrations"], first.counters["calibrations_cached"]) == (1, 0)
    assert len(list(cache.glob("probe-*.json"))) == 1
    second, log = started(serve, fake_model, *mode_flags(mode), "--calibration-cache", str(cache))
    assert (second.counters["calibrations"], second.counters["calibrations_cached"]) == (0, 1)
    assert f"kept in {cache}" in log
    assert second.calibration == first.calibration and second.calibration
    other, _ = started(serve, fake_model, *mode_flags(mode), "--calibration-cache", str(cache), "--n-ctx", "48")
    assert (other.counters["calibrations"], other.counters["calibrations_cached"]) == (1, 0)  # another key
    assert len(list(cache.glob("probe-*.json"))) == 2


def test_the_idle_spin_is_part_of_the_key_only_where_a_worker_has_more_than_one_thread(serve, fake_model, tmp_path):
    """The probe's step time depends on how a team's idle threads spin (--idle-spin): readings kept at one count are
    not taken at another where a worker has 2 threads; at 1 thread nothing spins, and they are."""
    cache = tmp_path / "calibration"
    two = ("--threads", "2", "--threads-per-worker", "2", "--calibration-cache", str(cache))
    counts = [started(serve, fake_model, *two, *spin)[0].counters for spin in ((), (), ("--idle-spin", "500"))]
    assert [(c["calibrations"], c["calibrations_cached"]) for c in counts] == [(1, 0), (0, 1), (1, 0)]
    one = ("--threads", "1", "--calibration-cache", str(cache))
    counts = [started(serve, fake_model, *one, *spin)[0].counters for spin in ((), ("--idle-spin", "500"))]
    assert [(c["calibrations"], c["calibrations_cached"]) for c in counts] == [(1, 0), (0, 1)]


def test_off_never_keeps_and_a_damaged_file_is_measured_again(serve, fake_model, tmp_path):
    cache = tmp_path / "calibration"
    started(serve, fake_model, "--calibration-cache", str(cache))
    (kept,) = cache.glob("probe-*.json")
    kept.write_text("{not json")
    again, _ = started(serve, fake_model, "--calibration-cache", str(cache))
    assert (again.counters["calibrations"], again.counters["calibrations_cached"]) == (1, 0)
    third, _ = started(serve, fake_model, "--calibration-cache", str(cache))
    assert third.counters["calibrations_cached"] == 1  # replaced by the new readings
    off, _ = started(serve, fake_model, "--calibration-cache", "off")
    assert off.counters["calibrations"] == 1


def test_by_default_the_readings_are_kept_in_the_users_cache_not_the_spill_dir(serve, fake_model, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    spill = ("--spill-dir", str(tmp_path / "spill"), "--spill-disk-budget", "1MiB")
    first, _ = started(serve, fake_model, *spill)
    restarted, log = started(serve, fake_model, *spill)
    assert (first.counters["calibrations"], restarted.counters["calibrations"], restarted.counters["calibrations_cached"]) == (1, 0, 1)
    assert f"kept in {tmp_path / 'xdg' / 'kvpool' / 'calibration'}" in log
    assert len(list((tmp_path / "xdg" / "kvpool" / "calibration").glob("probe-*.json"))) == 1
    assert not (tmp_path / "spill" / "calibration").exists()


def test_the_users_cache_follows_xdg_and_ignores_a_relative_value(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache_dir() == tmp_path / "kvpool"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value in ("relative/cache", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert user_cache_dir() == tmp_path / "home" / ".cache" / "kvpool"


def test_with_no_home_the_default_keeps_nothing(monkeypatch):
    def no_home() -> pathlib.Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pathlib.Path, "home", staticmethod(no_home))
    assert user_cache_dir() is None
    assert ServeConfig(model="m", socket="/tmp/s", calibration_cache="user").calibration_cache_dir is None
    assert ServeConfig(model="m", socket="/tmp/s", calibration_cache="off").calibration_cache_dir is None

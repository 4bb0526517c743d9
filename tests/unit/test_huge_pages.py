"""--huge-pages (kvpool.host, kvpool.daemon.config, kvpool.daemon.pool.process): a daemon's workers start with
glibc's malloc asking for transparent huge pages where the kernel offers them, the user's own tunables kept;
the supervisor's environment is as it was after each spawn; the calibration kept between starts is another
key with or without them. No model, no worker process (the real workers: tests/daemon/test_huge_pages.py)."""

from __future__ import annotations

import os
import threading

import pytest

import kvpool.host
from kvpool.cli.main import build_parser
from kvpool.daemon.config import ServeConfig
from kvpool.daemon.pool.process import spawn_environment
from kvpool.host import GLIBC_TUNABLES_ENV, asks_for_huge_pages, huge_page_environment, transparent_huge_pages, with_huge_page_malloc
from tests.support.fake_daemon import started

SETTING = "glibc.malloc.hugetlb=1"


@pytest.mark.parametrize(
    ("text", "mode"),
    [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"), ("always madvise [never]\n", "never"), ("garbled\n", "")],
)
def test_the_kernels_mode_is_the_bracketed_word(tmp_path, text, mode):
    enabled = tmp_path / "enabled"
    enabled.write_text(text)
    assert transparent_huge_pages(enabled) == mode


def test_no_such_file_is_no_mode(tmp_path):
    assert transparent_huge_pages(tmp_path / "absent") == ""


def test_the_tunable_is_added_beside_the_users_own_and_a_hugetlb_of_theirs_is_kept():
    assert with_huge_page_malloc(None) == SETTING
    assert with_huge_page_malloc("") == SETTING
    assert with_huge_page_malloc("glibc.malloc.arena_max=2") == f"glibc.malloc.arena_max=2:{SETTING}"
    assert with_huge_page_malloc("glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2") == "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"
    assert with_huge_page_malloc(f"::{SETTING}:") == SETTING  # empty items dropped, nothing added twice
    assert asks_for_huge_pages(SETTING) and asks_for_huge_pages("glibc.malloc.hugetlb=2")
    assert not asks_for_huge_pages("glibc.malloc.hugetlb=0") and not asks_for_huge_pages("glibc.malloc.arena_max=2") and not asks_for_huge_pages("")


@pytest.mark.parametrize("mode", ["always", "madvise"])
def test_a_kernel_that_offers_them_gets_the_tunable(monkeypatch, mode):
    monkeypatch.setattr(kvpool.host, "transparent_huge_pages", lambda: mode)
    monkeypatch.setenv(GLIBC_TUNABLES_ENV, "glibc.malloc.arena_max=2")
    assert huge_page_environment() == {GLIBC_TUNABLES_ENV: f"glibc.malloc.arena_max=2:{SETTING}"}
    config = ServeConfig(model="m", socket="/tmp/s")
    assert config.huge_pages == "auto"  # the default
    assert config.worker_environment == ((GLIBC_TUNABLES_ENV, f"glibc.malloc.arena_max=2:{SETTING}"),)
    assert config.huge_pages_used
    assert config.huge_pages_detail == f"workers' malloc asks for them (GLIBC_TUNABLES glibc.malloc.arena_max=2:{SETTING}; transparent huge pages: {mode})"
    off = ServeConfig(model="m", socket="/tmp/s", huge_pages="off")
    assert off.worker_environment == () and not off.huge_pages_used
    assert off.huge_pages_detail == f"off (--huge-pages off; transparent huge pages: {mode})"


@pytest.mark.parametrize("mode", ["never", ""])
def test_a_kernel_that_offers_none_gets_nothing(monkeypatch, mode):
    monkeypatch.setattr(kvpool.host, "transparent_huge_pages", lambda: mode)
    assert huge_page_environment() == {}
    config = ServeConfig(model="m", socket="/tmp/s")
    assert config.worker_environment == () and not config.huge_pages_used
    assert config.huge_pages_detail == f"off (transparent huge pages: {mode or 'not offered'})"


def test_the_users_hugetlb_0_is_kept_and_said(monkeypatch):
    monkeypatch.setattr(kvpool.host, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setenv(GLIBC_TUNABLES_ENV, "glibc.malloc.hugetlb=0")
    config = ServeConfig(model="m", socket="/tmp/s")
    assert config.worker_environment == ((GLIBC_TUNABLES_ENV, "glibc.malloc.hugetlb=0"),)
    assert not config.huge_pages_used
    assert config.huge_pages_detail == "off (transparent huge pages: madvise; GLIBC_TUNABLES glibc.malloc.hugetlb=0)"


def test_the_flag_takes_auto_or_off_only(capsys):
    parser = build_parser("serve")
    assert parser.parse_args(["serve", "--model", "m", "--socket", "s", "--huge-pages", "off"]).huge_pages == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--socket", "s", "--huge-pages", "always"])
    assert "invalid choice: 'always'" in capsys.readouterr().err


@pytest.mark.parametrize("before", [None, "glibc.malloc.arena_max=2"])
def test_a_spawn_sees_the_variables_and_the_supervisor_keeps_its_own(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(GLIBC_TUNABLES_ENV, raising=False)
    else:
        monkeypatch.setenv(GLIBC_TUNABLES_ENV, before)
    with spawn_environment(((GLIBC_TUNABLES_ENV, SETTING),)):
        assert os.environ[GLIBC_TUNABLES_ENV] == SETTING
    assert os.environ.get(GLIBC_TUNABLES_ENV) == before
    with pytest.raises(RuntimeError), spawn_environment(((GLIBC_TUNABLES_ENV, SETTING),)):
        raise RuntimeError("a spawn that failed")
    assert os.environ.get(GLIBC_TUNABLES_ENV) == before
    with spawn_environment(()):
        assert os.environ.get(GLIBC_TUNABLES_ENV) == before


def test_spawns_from_two_threads_each_see_the_variables(monkeypatch):
    monkeypatch.delenv(GLIBC_TUNABLES_ENV, raising=False)
    seen: list[str | None] = []
    inside = threading.Barrier(2, timeout=60)

    def spawn() -> None:
        try:
            inside.wait()  # both threads ask at once: the lock lets one in at a time
        except threading.BrokenBarrierError:
            pass
        with spawn_environment(((GLIBC_TUNABLES_ENV, SETTING),)):
            seen.append(os.environ.get(GLIBC_TUNABLES_ENV))

    threads = [threading.Thread(target=spawn) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [SETTING, SETTING]
    assert GLIBC_TUNABLES_ENV not in os.environ


def test_the_kept_calibration_is_another_key_with_huge_pages(serve, fake_model, tmp_path, monkeypatch):
    monkeypatch.setattr(kvpool.host, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.delenv(GLIBC_TUNABLES_ENV, raising=False)
    cache = tmp_path / "calibration"
    with_them, _ = started(serve, fake_model, "--calibration-cache", str(cache))
    without, _ = started(serve, fake_model, "--calibration-cache", str(cache), "--huge-pages", "off")
    again, _ = started(serve, fake_model, "--calibration-cache", str(cache), "--huge-pages", "off")
    assert [stats.counters["calibrations"] for stats in (with_them, without, again)] == [1, 1, 0]
    assert len(list(cache.glob("probe-*.json"))) == 2
    assert with_them.huge_pages.startswith("workers' malloc asks for them") and without.huge_pages.startswith("off (--huge-pages off")

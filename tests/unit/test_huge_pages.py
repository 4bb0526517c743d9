"""--huge-pages (workers.runtime.huge_pages, kvpool.daemon.config): after a load, the anonymous memory it mapped is
asked for in transparent huge pages where the kernel offers them, and nothing else; `off`, or a kernel that offers
none, asks nothing; the flag reaches every worker's spec and `kvpool status` says what it came to. No model, no
worker process (a real load: tests/daemon/test_huge_pages.py)."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from kvpool.cli.main import build_parser
from kvpool.daemon.config import ServeConfig
from tests.support.fake_daemon import started
from workers.runtime import huge_pages
from workers.runtime.huge_pages import (
    HUGE_PAGE_BYTES,
    Collapse,
    MappingWatch,
    anonymous_ranges,
    huge_page_bytes,
    new_ranges,
    transparent_huge_pages,
    whole_huge_pages,
)

MIB = 1024**2

MAPS = """\
55e7fc597000-55e7fc6eb000 rw-p 00000000 00:00 0                          [heap]
7f7b1eda7000-7f7b1fbe0000 rw-p 00000000 00:00 0
7f7b20000000-7f7b20400000 rw-s 00000000 00:01 1234                       /memfd:kvpool (deleted)
7f7b21000000-7f7b21200000 r--p 00000000 00:00 0
7f7b22000000-7f7b22400000 rw-p 00000000 08:01 42                         /models/shard.gguf
7f7b23000000-7f7b23200000 rw-p 00000000 00:00 0                          [anon:glibc: malloc arena]
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
"""


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


def test_only_private_writable_anonymous_mappings_count_and_not_the_heap():
    assert anonymous_ranges(MAPS) == [
        (0x7F7B1EDA7000, 0x7F7B1FBE0000),  # no name
        (0x7F7B23000000, 0x7F7B23200000),  # a named anonymous mapping
    ]  # the heap (brk would extend an advised top), shared, read-only, file-backed and the stack left out


@pytest.mark.parametrize(("text", "size"), [("2097152\n", 2 * MIB), ("536870912\n", 512 * MIB), ("garbled\n", HUGE_PAGE_BYTES), ("3000000\n", HUGE_PAGE_BYTES)])
def test_the_huge_page_size_is_the_kernels(tmp_path, text, size):
    path = tmp_path / "hpage_pmd_size"
    path.write_text(text)
    assert huge_page_bytes(path) == size
    assert huge_page_bytes(tmp_path / "absent") == HUGE_PAGE_BYTES
    assert whole_huge_pages([(MIB, 1030 * MIB)], 512 * MIB) == [(512 * MIB, 1024 * MIB)]


def test_an_unreadable_maps_asks_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "MAPS_PATH", tmp_path / "absent")
    collapse = MappingWatch(True).collapse()
    assert collapse.asked_bytes == 0 and collapse.skipped.startswith("/proc/self/maps unreadable: ")


def test_what_was_mapped_before_is_left_out_a_grown_mapping_counts_for_its_new_part():
    before = [(0x1000, 0x5000), (0x9000, 0xA000)]
    after = [(0x1000, 0x8000), (0x9000, 0xA000), (0x20000, 0x30000)]  # the first grew, the second is as it was
    assert new_ranges(before, after) == [(0x5000, 0x8000), (0x20000, 0x30000)]
    assert new_ranges([(0x2000, 0x3000)], [(0x1000, 0x4000)]) == [(0x1000, 0x2000), (0x3000, 0x4000)]  # merged around an old one
    assert new_ranges([], after) == after and new_ranges(after, after) == []


def test_only_whole_huge_pages_are_asked_for():
    page = HUGE_PAGE_BYTES
    assert whole_huge_pages([(page - 4096, 3 * page + 4096)]) == [(page, 3 * page)]
    assert whole_huge_pages([(page + 4096, 2 * page + 4096)]) == []  # no whole page inside
    assert whole_huge_pages([(0, page), (4 * page, 5 * page)]) == [(0, page), (4 * page, 5 * page)]


def test_off_or_a_kernel_that_offers_none_asks_nothing(monkeypatch):
    assert MappingWatch(False).collapse() == Collapse(skipped="--huge-pages off")
    for mode, said in (("never", "transparent huge pages: never"), ("", "transparent huge pages: not offered")):
        monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda mode=mode: mode)
        collapse = MappingWatch(True).collapse()
        assert collapse == Collapse(skipped=said, mode=mode)
        assert collapse.describe() == f"nothing asked ({said})"


def _huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of the mappings of this process that overlap [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(part, 16) for part in fields[0].split("-"))
                inside = low < end and start < high
            elif inside and fields[0] == "AnonHugePages:":
                total += int(fields[1]) * 1024
    return total


def test_memory_mapped_while_watched_is_collapsed_and_memory_mapped_before_is_not(monkeypatch):
    """Real madvise calls on this process's own memory: 16 MiB mapped (and written) before the watch are left as
    they are, 16 MiB mapped while it watches are asked for whole (at least 14 MiB of whole huge pages, wherever
    the kernel placed them) and, on a kernel with MADV_COLLAPSE that offers huge pages, sit in them after."""
    before = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    before.write(b"\1" * len(before))
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "madvise")
    watch = MappingWatch(True)
    during = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    during.write(b"\2" * len(during))
    try:
        collapse = watch.collapse()
        assert collapse.skipped == "" and 14 * MIB <= collapse.asked_bytes, collapse
        assert collapse.describe().startswith(f"{collapse.asked_bytes / MIB:.1f} MiB of its own memory asked for in ")
        assert collapse.describe().endswith(" s (transparent huge pages: madvise)") == (not collapse.refused)
        address = _address(during)
        old = _address(before)
        if not collapse.refused and transparent_huge_pages() in huge_pages.OFFERED:
            assert _huge_bytes_in(address, address + len(during)) >= 14 * MIB, collapse
        assert _huge_bytes_in(old, old + len(before)) == 0 or transparent_huge_pages() == "always"
        assert during[:1] == b"\2" and during[-1:] == b"\2" and before[-1:] == b"\1"  # collapsing moved the pages, not what is in them
    finally:
        during.close()
        before.close()


def _address(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def test_a_refusal_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "MADV_COLLAPSE", 0x7FFF)  # no such advice: EINVAL, as from a kernel before 6.1
    watch = MappingWatch(True)
    during = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    during.write(b"\3" * len(during))
    try:
        collapse = watch.collapse()
    finally:
        during.close()
    assert collapse.asked_bytes >= 6 * MIB and collapse.refused and all(item.startswith("MADV_COLLAPSE: EINVAL") for item in collapse.refused)
    assert "; refused: MADV_COLLAPSE: EINVAL" in collapse.describe()


def test_the_flag_takes_auto_or_off_only(capsys):
    parser = build_parser("serve")
    assert ServeConfig(model="m", socket="/tmp/s").huge_pages == "auto"  # the default
    assert parser.parse_args(["serve", "--model", "m", "--socket", "s", "--huge-pages", "off"]).huge_pages == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--socket", "s", "--huge-pages", "always"])
    assert "invalid choice: 'always'" in capsys.readouterr().err


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_the_flag_reaches_every_workers_spec_and_status(serve, fake_model, setting):
    daemon = serve(fake_model, "--huge-pages", setting, "--max-sessions", "2")
    try:
        assert daemon.supervisor.service.pool.spec.worker.huge_pages == (setting == "auto")
        with daemon.client() as client:
            said = client.stats().huge_pages
        assert said == f"--huge-pages {setting}"  # fake workers load nothing, so report nothing of a load
    finally:
        daemon.stop()


def test_the_kept_calibration_is_another_key_with_huge_pages(serve, fake_model, tmp_path):
    """The probe's step time depends on whether the weights sit in huge pages: auto and off keep apart readings."""
    cache = tmp_path / "calibration"
    with_them, _ = started(serve, fake_model, "--calibration-cache", str(cache))
    without, _ = started(serve, fake_model, "--calibration-cache", str(cache), "--huge-pages", "off")
    again, _ = started(serve, fake_model, "--calibration-cache", str(cache), "--huge-pages", "off")
    assert [stats.counters["calibrations"] for stats in (with_them, without, again)] == [1, 1, 0]
    assert len(list(cache.glob("probe-*.json"))) == 2

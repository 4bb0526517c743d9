"""A model's own anonymous memory moved into transparent huge pages right after its load.

On a CPU with kernels for them, llama.cpp repacks weights of some types (Q4_0, Q4_K, IQ4_NL, ...) into buffers of
its own, malloc'd and written during the load; a decode step reads all of them. On 4 KiB pages the same step on
the same data took 18.2-22.9 ms at ~1B depending on the process (where the buffers landed), on huge pages
18.1-18.3 ms with glibc's malloc asking for them and 18.2-18.8 ms collapsed after the load (evidence/daemon-overhead/
README.md, "Stop 42"). So a load asks the kernel to collapse the anonymous mappings it created (MADV_HUGEPAGE, then
MADV_COLLAPSE: Linux >= 6.1; the repacked weights and llama.cpp's other load buffers) and nothing else: contexts,
their KV caches and compute buffers keep the pages malloc gives them (asking glibc's malloc for huge pages for every
buffer made a fresh context's first creation stall now and then: "Stop 42", idle tables). The heap is left out even
where the load grew it: brk would extend an advised top of the heap, and memory a context takes there later could
then be collapsed behind the daemon's readings.

What counts as the load's is the anonymous memory mapped during it: a buffer malloc places in memory mapped before
(glibc's heap, below its mmap threshold: 128 KiB in a worker, which fixes it, up to 32 MiB elsewhere) is not
asked for; a repacked shard of a real model is one buffer far above that. The watch sees the whole process: a
mapping another thread makes during the load would be asked for too (kvpool loads one model at a time, in a worker
before anything else, or in a tool's own process).

Where the kernel offers no transparent huge pages (mode `never`, or none) nothing is asked. A kernel without
MADV_COLLAPSE refuses it (EINVAL): the mappings stay madvised MADV_HUGEPAGE, and khugepaged may collapse them
later; EINVAL can also mean a range the kernel would not collapse as it is. Nothing here is fatal to a load: what
was asked and refused is reported (Collapse), and a /proc/self/maps that cannot be read asks nothing."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import pathlib
import time
from collections.abc import Iterable, Sequence

THP_ENABLED_PATH = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
MAPS_PATH = pathlib.Path("/proc/self/maps")
PMD_SIZE_PATH = pathlib.Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
HUGE_PAGE_BYTES = 2 * 1024**2  # x86-64's and arm64's (4 KiB base pages) transparent huge page, where the kernel does not say
MADV_HUGEPAGE = 14  # <sys/mman.h>
MADV_COLLAPSE = 25  # Linux >= 6.1
OFFERED = ("always", "madvise")

Range = tuple[int, int]  # [start, end) of a virtual address range


def transparent_huge_pages(path: pathlib.Path = THP_ENABLED_PATH) -> str:
    """The kernel's transparent huge page mode for anonymous memory: always, madvise or never; "" where the
    kernel says nothing (no such file: not Linux, or built without THP)."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def huge_page_bytes(path: pathlib.Path = PMD_SIZE_PATH) -> int:
    """The kernel's transparent huge page size (HUGE_PAGE_BYTES where it does not say)."""
    try:
        size = int(path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return HUGE_PAGE_BYTES
    return size if size > 0 and size & (size - 1) == 0 else HUGE_PAGE_BYTES


def anonymous_ranges(maps: str) -> list[Range]:
    """The private, writable anonymous mappings of a /proc/PID/maps text (no file behind them: no path, or a named
    anonymous mapping's bracketed name), in order; the heap left out (above)."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p":
            continue
        name = fields[5].strip() if len(fields) == 6 else ""
        if name and not name.startswith("[anon:"):
            continue
        start, _, end = fields[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    return ranges


def new_ranges(before: Sequence[Range], after: Sequence[Range]) -> list[Range]:
    """What of `after` no range of `before` covered: the memory mapped in between (a mapping that grew or merged
    with a neighbour counts only for its new part)."""
    out = []
    for start, end in after:
        pieces = [(start, end)]
        for old_start, old_end in before:
            pieces = [part for piece_start, piece_end in pieces for part in _minus(piece_start, piece_end, old_start, old_end)]
        out.extend(pieces)
    return out


def _minus(start: int, end: int, old_start: int, old_end: int) -> list[Range]:
    if old_end <= start or end <= old_start:
        return [(start, end)]
    return [(a, b) for a, b in ((start, old_start), (old_end, end)) if a < b]


def whole_huge_pages(ranges: Iterable[Range], page: int = HUGE_PAGE_BYTES) -> list[Range]:
    """Each range cut to the huge pages of `page` bytes that lie wholly inside it (none: left out)."""
    mask = page - 1
    cut = [((start + mask) & ~mask, end & ~mask) for start, end in ranges]
    return [(start, end) for start, end in cut if start < end]


@dataclasses.dataclass(frozen=True, slots=True)
class Collapse:
    """What a load's collapse asked and what the kernel refused."""

    asked_bytes: int = 0  # in whole huge pages of the mappings the load created
    seconds: float = 0.0
    refused: tuple[str, ...] = ()  # "MADV_COLLAPSE: EINVAL (12 MiB: Invalid argument)", one per refusal
    skipped: str = ""  # why nothing was asked ("" when something was)
    mode: str = ""  # the kernel's transparent huge page mode when asked

    def describe(self) -> str:
        """What was asked and refused, in words."""
        if self.skipped:
            return f"nothing asked ({self.skipped})"
        said = f"{self.asked_bytes / 2**20:.1f} MiB of its own memory asked for in {self.seconds:.2f} s (transparent huge pages: {self.mode})"
        return said + (f"; refused: {', '.join(self.refused)}" if self.refused else "")


class MappingWatch:
    """The anonymous mappings of this process before something runs; `collapse()` afterwards asks for huge pages
    for those that appeared (nothing where `enabled` is False or the kernel offers no transparent huge pages)."""

    def __init__(self, enabled: bool) -> None:
        self.mode = transparent_huge_pages() if enabled else ""
        self.skipped = "--huge-pages off" if not enabled else "" if self.mode in OFFERED else f"transparent huge pages: {self.mode or 'not offered'}"
        self.before: list[Range] = []
        if not self.skipped:
            try:
                self.before = anonymous_ranges(_read_maps())
            except OSError as error:
                self.skipped = f"/proc/self/maps unreadable: {error}"

    def collapse(self) -> Collapse:
        if self.skipped:
            return Collapse(skipped=self.skipped, mode=self.mode)
        started = time.perf_counter()
        try:
            after = anonymous_ranges(_read_maps())
        except OSError as error:
            return Collapse(skipped=f"/proc/self/maps unreadable: {error}", mode=self.mode)
        ranges = whole_huge_pages(new_ranges(self.before, after), huge_page_bytes())
        refused = tuple(filter(None, (_advise(start, end) for start, end in ranges)))
        return Collapse(asked_bytes=sum(end - start for start, end in ranges), seconds=time.perf_counter() - started, refused=refused, mode=self.mode)


def _read_maps() -> str:
    return MAPS_PATH.read_text(encoding="ascii", errors="replace")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _advise(start: int, end: int) -> str:
    """MADV_HUGEPAGE, then MADV_COLLAPSE, on [start, end); "" when both were done, else what was refused."""
    for name, advice in (("MADV_HUGEPAGE", MADV_HUGEPAGE), ("MADV_COLLAPSE", MADV_COLLAPSE)):
        if _libc.madvise(start, end - start, advice) != 0:
            code = ctypes.get_errno()
            return f"{name}: {errno.errorcode.get(code, str(code))} ({(end - start) / 2**20:.0f} MiB: {os.strerror(code)})"
    return ""

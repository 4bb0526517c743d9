"""What the bench checks of its own runs before it turns figures into ratios (issue 29): the machine's load
during each section (`LoadMeter`, `section_load`, the contention rule `is_contended`), a llama.cpp
reference that decodes slower batched than alone (`broken_reference`), a whole model's reference slower than the
same model's shards in one process (`slow_reference`: the route is then measured against the shards), how many rounds each timed figure
has (`round_spreads`), and the withheld verdict a ratio gets when one of them fails (`withhold`)."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import psutil

CONTENDED = "contended: not a ratio"
BROKEN = "broken reference: not a ratio"
# Other processes may use at most this many cores' worth of CPU time during a section (a tenth of one core).
# An idle Linux machine's own background (kernel threads, journald, sshd) stays near 0.01-0.03 cores, so
# the rule does not fire on noise; anything that takes a core even a tenth of the time does fire, and that
# is already enough to stall llama.cpp's 2-thread references, whose OpenMP threads spin at every barrier
# and wait for the one that was descheduled (issue 29: a batched 4-row step then cost 11x a 1-row step).
CONTENDED_CORES = 0.10
MIN_ROUNDS = 3  # a timed figure is a measurement with at least this many rounds (min / median / max)


def is_contended(load: dict) -> bool:
    """Whether other processes used more than CONTENDED_CORES cores' worth of CPU during a section (its
    `other_cores`: their CPU seconds / the section's wall seconds). At exactly the threshold: not contended.
    Such a section's figures are kept, but none of its ratios gets a verdict (see CONTENDED_CORES: why)."""
    return load["other_cores"] > CONTENDED_CORES


def broken_reference(batched_tok_s: float, alone_tok_s: float) -> bool:
    """Whether llama.cpp's batched decoding of N sequences is a broken reference: N rows in one llama_decode
    cost at most N one-row steps on any machine where the reference is fed (the weights are read once for
    all rows), so aggregate tokens/s batched below one sequence's tokens/s alone in the same context (or the
    same model) means the reference was starved, not measured. Equal rates: not broken."""
    return batched_tok_s < alone_tok_s


def slow_reference(whole_s: float, shards_s: float) -> bool:
    """Whether the whole model in one llama.cpp context is a slow reference: the same model's shards in one
    process (kvpool's LocalChain: a context a shard, each with the capture callback, the rows handed on in
    Python) compute every layer the whole model does and more, so a whole model's decode step slower than
    theirs (medians, seconds) is not the best llama.cpp does on the machine (in a fresh process of its own the
    ~1B model's whole context and its shards' read within 1.6% of each other, stop 57; in the bench's process,
    beside every other model it loads, the quick tables of stops 56 and 57 read the shards at 1.022x and 1.107x
    the whole model). Section 2 then takes the shards' time as the route's reference. Equal: not slow. The rule
    is strict, so a difference within noise gives way to the shards too: the reference is then the faster of
    two medians, which errs against kvpool's ratio, never for it."""
    return whole_s > shards_s


def withhold(ratio: dict, reason: str) -> dict:
    """A JSON "ratios" entry whose value is kept but whose verdict is `reason` (met: None, no comparison);
    a reason it already had is kept before it."""
    verdict = f"{ratio['verdict']}; {reason}" if ratio.get("verdict") not in (None, reason) else reason
    return {**ratio, "met": None, "verdict": verdict}


MET, MISSED, NO_TARGET = "met", "MISSED", "no target"  # a ratio's verdict where nothing withheld it
VERDICTS = (MET, MISSED, NO_TARGET)


def with_verdict(ratio: dict) -> dict:
    """A "ratios" entry with its "verdict": the reason it was withheld, or met / MISSED / no target."""
    if "verdict" in ratio:
        return ratio
    verdict = NO_TARGET if ratio["met"] is None else (MET if ratio["met"] else MISSED)
    return {**ratio, "verdict": verdict}


# ---- the machine's load during a section -------------------------------------------------------------


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine spent running code since boot (user, nice, system, interrupts)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0.0) + getattr(times, "softirq", 0.0)


def _tree_cpu_s() -> float:
    """CPU seconds of this process and every process under it: the live ones' own time and, through
    children_user/children_system, that of those already waited for (the daemons it started are its)."""
    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSample:
    at_s: float  # perf_counter
    load_average: tuple[float, float, float]
    busy_cpu_s: float  # the whole machine's
    tree_cpu_s: float  # this process tree's

    @classmethod
    def now(cls) -> LoadSample:
        return cls(time.perf_counter(), os.getloadavg(), _busy_cpu_s(), _tree_cpu_s())


def section_load(start: LoadSample, end: LoadSample, cores: int) -> dict:
    """The JSON "load" of one section: load averages at its start and end, the CPU seconds other processes
    used during it, that as cores' worth (/ wall s) and as a share of wall s x cores, and `contended`."""
    wall_s = max(end.at_s - start.at_s, 1e-9)
    other_s = max((end.busy_cpu_s - start.busy_cpu_s) - (end.tree_cpu_s - start.tree_cpu_s), 0.0)
    load = {"load_average_at_start": list(start.load_average), "load_average_at_end": list(end.load_average), "wall_s": wall_s,
            "cores": cores, "other_processes_cpu_s": other_s, "other_cores": other_s / wall_s,
            "other_share_of_cores": other_s / (wall_s * cores), "contended_above_cores": CONTENDED_CORES}
    load["contended"] = is_contended(load)
    return load


class LoadMeter:
    """Records each section's load into `loads` (results["load"]): `with meter.section("parallel"): ...`."""

    def __init__(self) -> None:
        self.loads: dict[str, dict] = {}
        self.cores = psutil.cpu_count(logical=True) or os.cpu_count() or 1

    def section(self, name: str) -> _Section:
        return _Section(self, name)


class _Section:
    def __init__(self, meter: LoadMeter, name: str) -> None:
        self.meter, self.name = meter, name

    def __enter__(self) -> None:
        self.start = LoadSample.now()

    def __exit__(self, *_exc) -> None:
        self.meter.loads[self.name] = section_load(self.start, LoadSample.now(), self.meter.cores)


def contended_lines(loads: dict[str, dict]) -> list[str]:
    """One line per contended section, for the end of a run."""
    return [f"section {name!r} was contended: other processes used {load['other_cores']:.2f} cores "
            f"({load['other_processes_cpu_s']:.1f} CPU-s in {load['wall_s']:.0f} s; threshold {CONTENDED_CORES:.2f}); "
            f"load average {load['load_average_at_start'][0]:.2f} -> {load['load_average_at_end'][0]:.2f}; its ratios are not verdicts"
            for name, load in loads.items() if load["contended"]]


# ---- rounds of each timed figure ---------------------------------------------------------------------


def round_spreads(section: object, path: str = "") -> dict[str, dict]:
    """Every list of numbers under a section's results (a timed figure's rounds; a list of one dict per round
    counts each key as one) by its key path: rounds, min, median, max, and whether it has MIN_ROUNDS."""
    spreads: dict[str, dict] = {}
    if isinstance(section, dict):
        for key, value in section.items():
            spreads.update(round_spreads(value, f"{path}/{key}" if path else str(key)))
    elif isinstance(section, list) and section and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in section):
        values = [float(v) for v in section if math.isfinite(v)]
        if values:
            spreads[path] = {"rounds": len(values), "min": min(values), "median": statistics.median(values), "max": max(values),
                             "enough": len(values) >= MIN_ROUNDS}
    elif isinstance(section, list) and section and all(isinstance(v, dict) for v in section) and len({frozenset(v) for v in section}) == 1:
        # one dict per round: each of its keys is a figure over the rounds
        spreads.update(round_spreads({key: [value[key] for value in section] for key in section[0]}, path))
    elif isinstance(section, list):
        for index, value in enumerate(section):
            spreads.update(round_spreads(value, f"{path}/{index}"))
    return spreads

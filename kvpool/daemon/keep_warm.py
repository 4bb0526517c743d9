"""Keeping the CPUs awake between a session's requests (`kvpool serve --keep-warm SECONDS`).

A route's decode step wakes every shard's worker once: it waits, blocked, while the other shards compute, and its
CPU, with nothing else to run, halts; the whole model in one process never blocks and never halts its CPU. On a
2-core KVM guest (AMD EPYC) the ~1B route of 3 daemons, the whole model in one process taking turns with it, read
0.926 and 0.9435 of the whole model (medians of two series) with the CPUs left to halt, 0.951 and 0.9515 with this,
ahead in 11 of 14 alternated pairs (evidence/daemon-overhead/README.md, "Stop 49"): a small gain against that host's
spread, presumably the halted CPU's wake-up (not traced; in one process with the spinners stopped and continued turn
by turn no gain showed).

So after each session request (its end: kvpool.daemon.gate.Gate.leave, and every append on a worker's direct
channel) the daemon keeps one spinner process on each CPU it may run on busy for --keep-warm seconds: pinned to
its CPU, SCHED_IDLE (the kernel runs it only when nothing else wants that CPU, and any task that wakes there takes
the CPU from it at once), so a worker or a client that wakes finds its CPU running. One spinner a CPU for the whole
machine: a spinner spins only while it holds its CPU's lock (a file in the temporary directory, flock), so the
daemons of a route on one machine do not stack spinners on a CPU; the others wait for the lock asleep in the kernel
(a spinner that woke every few milliseconds to try again cost the computing worker its CPU now and then). Past the
window the spinners sleep (a look every 50 ms). A spinner dies with its daemon (PR_SET_PDEATHSIG, and a look at its
parent while it spins or sleeps). The spinner itself: kvpool.daemon.keep_warm_spinner; the block the spinners watch
and the requests touch: workers.server.keep_warm_stamp.

Off by default (--keep-warm 0: no spinner is started): it is for a machine given to the route. Idle priority does not
make it free where it was not measured: under a CPU quota (a cgroup's cpu.max, a container's --cpus) the spinners'
time counts against the quota and can get the daemon's group throttled; on a core whose sibling hyperthread a spinner
holds, the computing worker shares the core; a busy package may lose turbo headroom; and the CPUs show busy. The
first two are looked for when the spinners start (hazards(): said when the daemon starts and by `kvpool status`);
the daemon keeps them on all the same, as asked."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from multiprocessing import shared_memory

from workers.server.keep_warm_stamp import ASLEEP, BLOCK_BYTES, MAX_SPINNERS, SPINNING, STARTING, WAITING, Stamp

MAX_KEEP_WARM_S = 3600.0  # --keep-warm: an hour of spinning after a request is surely a typo
SPINNER_MODULE = "kvpool.daemon.keep_warm_spinner"  # started as `python -m`: one process a CPU
STATE_WORDS = {STARTING: "starting", ASLEEP: "asleep", WAITING: "waiting for its CPU", SPINNING: "spinning"}
SYSFS_CPUS = pathlib.Path("/sys/devices/system/cpu")


def check_keep_warm(seconds: float) -> float:
    """The one rule of --keep-warm (the daemon's and the bench's): a window in [0, MAX_KEEP_WARM_S] seconds."""
    if not 0 <= seconds <= MAX_KEEP_WARM_S:  # NaN fails both comparisons
        raise ValueError(f"--keep-warm must be in [0, {MAX_KEEP_WARM_S:g}] seconds (got {seconds:g})")
    return seconds


def cpu_quota(proc_cgroup: str, mountinfo: str) -> str:
    """The CPU quota the calling process runs under, from its /proc/self/cgroup and /proc/self/mountinfo texts:
    cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us, in its own cgroup or any above it that its
    cgroup mount shows (inside a cgroup namespace a quota above the namespace's root is not seen), the tightest as
    cores; "" when none is set or none can be read. Lines it cannot read are passed over."""
    mounts: list[tuple[str, pathlib.Path, str]] = []  # (kind, mount point, the cgroup path it shows)
    for line in mountinfo.splitlines():
        fields = line.split()
        after = line.split(" - ", 1)[1].split() if " - " in line else []
        if len(fields) < 5 or len(after) < 3:
            continue
        kind, options = after[0], after[2]
        shown, point = _unescape(fields[3]), pathlib.Path(_unescape(fields[4]))
        if kind == "cgroup2":
            mounts.append(("v2", point, shown))
        elif kind == "cgroup" and "cpu" in options.split(","):
            mounts.append(("v1", point, shown))
    tightest: tuple[float, str] | None = None
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if hierarchy == "0" and controllers == "" else "v1" if "cpu" in controllers.split(",") else None
        for kind, point, shown in mounts:
            base = shown.rstrip("/")
            if kind != version or not (path + "/").startswith(base + "/"):
                continue  # another hierarchy's mount, or one showing a cgroup beside ours (a namespace's "/..")
            relative = pathlib.PurePosixPath(path[len(base):].lstrip("/"))
            for level in [relative, *relative.parents]:
                cores = _quota_cores(point / level, kind)
                if cores is not None and (tightest is None or cores < tightest[0]):
                    tightest = (cores, str(pathlib.PurePosixPath(shown) / level))
    if tightest is None:
        return ""
    cores, where = tightest
    return f"a CPU quota of {cores:g} core{'' if cores == 1 else 's'} (cgroup {where})"


def _unescape(field: str) -> str:
    """A mountinfo path field as the path: the kernel writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), field)


def _quota_cores(directory: pathlib.Path, kind: str) -> float | None:
    try:
        if kind == "v2":
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota, period = ((directory / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def hyperthread_siblings(cpus: list[int], sysfs: pathlib.Path = SYSFS_CPUS) -> list[list[int]]:
    """The groups of `cpus` that share a core (each group's CPUs among `cpus`, two or more), by sysfs."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in cpus:
        try:
            siblings = _cpu_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            continue
        groups.setdefault(tuple(sorted(siblings)), []).append(cpu)
    return [sorted(group) for group in groups.values() if len(group) > 1]


def _cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11") as numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def hazards(cpus: list[int], *, proc: pathlib.Path = pathlib.Path("/proc/self"), sysfs: pathlib.Path = SYSFS_CPUS) -> str:
    """What on this machine makes the spinners cost more than they were measured to ("": nothing found)."""
    found = []
    try:
        quota = cpu_quota((proc / "cgroup").read_text(errors="surrogateescape"), (proc / "mountinfo").read_text(errors="surrogateescape"))
    except (OSError, ValueError):  # not readable here: nothing said rather than no daemon
        quota = ""
    if quota:
        found.append(f"{quota}: the spinners' time counts against it and can get the daemon throttled")
    shared = hyperthread_siblings(cpus, sysfs)
    if shared:
        found.append("hyperthread siblings " + ", ".join("+".join(map(str, group)) for group in shared)
                     + ": a spinner shares the computing worker's core")
        # not skipped: which sibling a worker wakes on is the scheduler's; off (--keep-warm 0) is the remedy
    return "; ".join(found)


class KeepWarm:
    """The supervisor's side: the block (a shared-memory segment its workers attach by name) and the spinners."""

    def __init__(self, window_s: float, cpus: list[int] | None = None) -> None:
        self.window_s = window_s
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))[:MAX_SPINNERS] if window_s > 0 else []
        self.hazards = hazards(self.cpus) if self.cpus else ""  # said when the daemon starts and by describe(); before the block: nothing to free
        self._block = shared_memory.SharedMemory(create=True, size=BLOCK_BYTES) if window_s > 0 else None
        self.stamp = Stamp(self._block.buf) if self._block is not None else None
        if self.stamp is not None:
            self.stamp.forget()
        self._spinners: list[subprocess.Popen] = []
        self.not_started = ""  # why the spinners could not be started ("": they were, or none was asked)

    @property
    def name(self) -> str:
        """The block's name for the workers ("": keeping warm is off)."""
        return self._block.name if self._block is not None else ""

    def start(self) -> str:
        """One spinner process per CPU (nothing when off). A spinner that cannot be started stops none of the
        daemon's work: why is returned (and said by describe()), "" when all started."""
        for slot, cpu in enumerate(self.cpus):
            command = [
                sys.executable, "-m", SPINNER_MODULE, "--block", self.name, "--slot", str(slot), "--cpu", str(cpu),
                "--window", repr(self.window_s), "--parent", str(os.getpid()),
            ]
            try:
                self._spinners.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True))
            except OSError as error:
                self.not_started = f"spinners not started: {error}"
                break
        return self.not_started

    def touch(self) -> None:
        if self.stamp is not None:
            self.stamp.touch()

    def pids(self) -> list[int]:
        return [spinner.pid for spinner in self._spinners]

    def describe(self) -> str:
        """For `kvpool status`: the setting and what each spinner does now."""
        if self.stamp is None:
            return "off (--keep-warm 0)"
        states = ", ".join(
            f"cpu {cpu} {STATE_WORDS.get(self.stamp.state(slot), '?') if spinner.poll() is None else f'exited ({spinner.returncode})'}"
            for slot, (cpu, spinner) in enumerate(zip(self.cpus, self._spinners))
        )
        states = "; ".join(filter(None, (states, self.not_started, self.hazards and f"hazards: {self.hazards}")))
        last = self.stamp.last_request
        since = f"the last session request ended {time.monotonic() - last:.3f} s ago" if math.isfinite(last) else "no session request yet"
        return f"{self.window_s:g} s after each session request, one idle-priority spinner a CPU ({states or 'none started'}); {since}"

    def close(self) -> None:
        """Stop the spinners and free the block; idempotent."""
        for spinner in self._spinners:
            with contextlib.suppress(OSError):
                spinner.kill()
        for spinner in self._spinners:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spinner.wait(timeout=5.0)
        self._spinners = []
        if self._block is not None:
            self.stamp.release()
            self._block.close()
            with contextlib.suppress(FileNotFoundError):
                self._block.unlink()
            self._block = None
            self.stamp = None

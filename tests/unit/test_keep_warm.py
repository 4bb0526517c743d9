"""--keep-warm (kvpool.daemon.keep_warm): real spinner processes on a block of their own, each test's CPU locks in a
directory of its own (TMPDIR); what a spinner does is read from its state byte, never from its speed (a SCHED_IDLE
process on a busy machine may wait long for a CPU: the waits are hang guards)."""

from __future__ import annotations

import fcntl
import math
import os
import pathlib
import select
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kvpool.daemon.config import ServeConfig
from kvpool.daemon.keep_warm import MAX_KEEP_WARM_S, KeepWarm, hazards
from kvpool.daemon.keep_warm_spinner import lock_path
from tests.support.daemons import HANG_GUARD_S, exited_all, wait_until
from workers.server.keep_warm_stamp import ASLEEP, SPINNING, STARTING, WAITING

CPU = min(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def own_locks(tmp_path, monkeypatch):
    """The spinners' CPU locks in this test's directory: a daemon elsewhere on the machine neither waits for them nor holds them."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    return tmp_path


def keep_warm(window_s: float) -> KeepWarm:
    warm = KeepWarm(window_s, cpus=[CPU])
    warm.start()
    return warm


def settled(warm: KeepWarm, slot: int = 0) -> None:
    """The spinner runs as it should: pinned to its CPU, SCHED_IDLE (it sets both itself as it starts), and past its
    start (its state no longer the block's zero)."""
    pid = warm.pids()[slot]
    wait_until(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE and os.sched_getaffinity(pid) == {CPU}, "the spinner's SCHED_IDLE on its CPU")
    wait_until(lambda: warm.stamp.state(slot) != STARTING, "the spinner past its start")


def test_off_starts_nothing_and_says_so():
    warm = keep_warm(0.0)
    try:
        assert warm.name == "" and warm.pids() == [] and warm.describe() == "off (--keep-warm 0)"
        warm.touch()  # a request's end with keeping warm off: nothing to write
    finally:
        warm.close()


def test_a_request_wakes_the_spinner_and_the_window_puts_it_back_to_sleep():
    """A long window, ended by the test (the stamp set back to "no request"): a spinner slow to get its CPU, at idle
    priority on a busy machine, is still seen in each state."""
    warm = keep_warm(60.0)
    try:
        assert "no session request yet" in warm.describe()
        settled(warm)
        assert warm.stamp.state(0) == ASLEEP  # no request yet (the stamp starts at -inf, not at the clock's zero)
        assert f"cpu {CPU} asleep" in warm.describe()
        warm.touch()
        wait_until(lambda: warm.stamp.state(0) == SPINNING, "the spinner spinning after a request")
        assert f"cpu {CPU} spinning" in warm.describe() and "the last session request ended" in warm.describe()
        assert lock_path(CPU).parent == pathlib.Path(os.environ["TMPDIR"])
        warm.stamp.forget()  # the window over
        wait_until(lambda: warm.stamp.state(0) == ASLEEP, "the spinner asleep once the window passed")
    finally:
        warm.close()


def test_one_spinner_a_cpu_across_daemons():
    first, second = keep_warm(60.0), keep_warm(60.0)
    try:
        settled(first)
        settled(second)
        first.touch()
        wait_until(lambda: first.stamp.state(0) == SPINNING, "the first daemon's spinner spinning")
        second.touch()
        wait_until(lambda: second.stamp.state(0) == WAITING, "the second daemon's spinner waiting for the CPU's lock")
        first.close()  # its spinner killed: the lock is free
        wait_until(lambda: second.stamp.state(0) == SPINNING, "the second daemon's spinner spinning once the first is gone")
    finally:
        first.close()
        second.close()


def test_close_stops_the_spinners_and_frees_the_block():
    warm = keep_warm(60.0)
    spinners, name = [psutil.Process(pid) for pid in warm.pids()], warm.name
    warm.touch()
    warm.close()
    warm.close()  # idempotent
    assert exited_all(spinners, "the spinners after close") == []
    assert not pathlib.Path(f"/dev/shm/{name}").exists()


@pytest.mark.parametrize("state", ["asleep", "spinning", "waiting"])
def test_a_spinner_whose_daemon_dies_exits(state):
    """The supervisor killed (SIGKILL: no close): its spinners go too, asleep, spinning or waiting for the CPU's
    lock (held here by the test, as another daemon's spinner would: blocked in flock, only the kernel's
    PR_SET_PDEATHSIG ends it)."""
    touched = state != "asleep"
    script = textwrap.dedent(f"""
        import sys, time
        from kvpool.daemon.keep_warm import KeepWarm
        warm = KeepWarm(60.0, cpus=[{CPU}]); warm.start()
        if {touched}: warm.touch()
        while warm.stamp.state(0) != {dict(asleep=ASLEEP, spinning=SPINNING, waiting=WAITING)[state]}:
            time.sleep(0.01)
        print(warm.pids()[0], flush=True)
        time.sleep(600)
    """)
    holder = os.open(lock_path(CPU), os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        if state == "waiting":
            fcntl.flock(holder, fcntl.LOCK_EX)
        parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=pathlib.Path(__file__).parents[2])
        try:
            ready, _, _ = select.select([parent.stdout], [], [], HANG_GUARD_S)
            assert ready, f"hang guard: the daemon's spinner not {state} after {HANG_GUARD_S:.0f} s"
            spinner = psutil.Process(int(parent.stdout.readline()))
        finally:
            parent.send_signal(signal.SIGKILL)
            parent.wait()
        assert exited_all([spinner], "the spinner after its daemon died") == []
    finally:
        os.close(holder)


def test_a_session_request_through_the_supervisor_wakes_the_spinners(serve, fake_model):
    """Gate.leave touches the stamp (a worker's direct channel does too: tests/daemon/test_keep_warm.py)."""
    daemon = serve(fake_model, "--keep-warm", "60")
    warm = daemon.supervisor.service.keep_warm
    assert warm.stamp.last_request == -math.inf and warm.pids()
    before = time.monotonic()
    with daemon.client() as client:
        client.append("a", 1, 0, tokens=[5, 6, 7])
    assert warm.stamp.last_request >= before
    wait_until(lambda: SPINNING in [warm.stamp.state(slot) for slot in range(len(warm.cpus))], "a spinner spinning after the append")
    with daemon.client() as client:
        assert "spinning" in client.stats().keep_warm


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, MAX_KEEP_WARM_S + 1])
def test_the_flag_refuses_what_is_not_a_window(bad):
    with pytest.raises(ValueError, match=r"--keep-warm must be in \[0, 3600\] seconds"):
        ServeConfig(model="m", socket="/tmp/s", keep_warm_s=bad)


def test_the_flag_takes_0_to_its_limit_and_is_off_by_default():
    assert ServeConfig(model="m", socket="/tmp/s").keep_warm_s == 0.0
    assert ServeConfig(model="m", socket="/tmp/s", keep_warm_s=0.0).keep_warm_s == 0.0
    assert ServeConfig(model="m", socket="/tmp/s", keep_warm_s=MAX_KEEP_WARM_S).keep_warm_s == MAX_KEEP_WARM_S


def fake_machine(root: pathlib.Path, *, cgroup: str, mounts: list[str], files: dict[str, str]) -> pathlib.Path:
    """A /proc/self (cgroup, mountinfo) and cgroup and sysfs files under `root`; mount points in `mounts` and the
    keys of `files` are relative to it."""
    proc = root / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(f"{30 + index} 23 0:{28 + index} {line.replace('@', str(root))}\n" for index, line in enumerate(mounts)))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc


def test_hazards_name_a_cgroup_v2_quota_above_the_daemon_and_none_when_unlimited(tmp_path):
    mounts = ["/ @/cg rw,nosuid - cgroup2 cgroup2 rw"]
    files = {"cg/cpu.max": "max 100000\n", "cg/box/cpu.max": "150000 100000\n", "cg/box/svc/cpu.max": "max 100000\n"}
    proc = fake_machine(tmp_path, cgroup="0::/box/svc\n", mounts=mounts, files=files)
    said = hazards([0, 1], proc=proc, sysfs=tmp_path / "nosys")
    assert said.startswith("a CPU quota of 1.5 cores (cgroup /box)") and "throttled" in said
    (tmp_path / "cg/box/cpu.max").write_text("max 100000\n")
    assert hazards([0, 1], proc=proc, sysfs=tmp_path / "nosys") == ""


@pytest.mark.parametrize(("parent", "child", "said"), [("200000", "50000", "0.5 cores (cgroup /a/b)"), ("100000", "300000", "1 core (cgroup /a)")])
def test_hazards_name_the_tightest_quota_on_the_way_up(tmp_path, parent, child, said):
    files = {"cg/a/cpu.max": f"{parent} 100000\n", "cg/a/b/cpu.max": f"{child} 100000\n"}
    proc = fake_machine(tmp_path, cgroup="0::/a/b\n", mounts=["/ @/cg rw - cgroup2 cgroup2 rw"], files=files)
    assert hazards([0], proc=proc, sysfs=tmp_path / "nosys").startswith(f"a CPU quota of {said}:")


def test_hazards_name_the_tightest_cgroup_v1_quota_and_only_the_cpu_hierarchy(tmp_path):
    mounts = ["/ @/cpu rw - cgroup cgroup rw,cpu,cpuacct", "/ @/memory rw - cgroup cgroup rw,memory"]
    files = {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
        "cpu/job/cpu.cfs_quota_us": "50000\n", "cpu/job/cpu.cfs_period_us": "100000\n",
        "memory/other/cpu.cfs_quota_us": "1000\n", "memory/other/cpu.cfs_period_us": "100000\n",  # not a cpu hierarchy
    }
    proc = fake_machine(tmp_path, cgroup="4:memory:/other\n2:cpu,cpuacct:/job\n0::/\n", mounts=mounts, files=files)
    assert hazards([0], proc=proc, sysfs=tmp_path / "nosys").startswith("a CPU quota of 0.5 cores (cgroup /job)")
    (tmp_path / "cpu/job/cpu.cfs_quota_us").write_text("-1\n")
    assert hazards([0], proc=proc, sysfs=tmp_path / "nosys") == ""


def test_hazards_read_a_container_s_mount_escaped_paths_and_pass_over_odd_lines(tmp_path):
    """A container's v1 mount shows its own cgroup as the root (named by the cgroup path, not the mount's); a path
    with a space is written \\040 in mountinfo; a line with an empty source or cut short stops nothing."""
    mounts = ["/docker/c1 @/cpu\\040dir rw - cgroup cgroup rw,cpu", "/ /dev/shm rw - tmpfs  rw", "garbage", "1 2 3 - cgroup2"]
    files = {"cpu dir/cpu.cfs_quota_us": "25000\n", "cpu dir/cpu.cfs_period_us": "100000\n"}
    proc = fake_machine(tmp_path, cgroup="3:cpu:/docker/c1\nnot a line\n", mounts=mounts, files=files)
    assert hazards([0], proc=proc, sysfs=tmp_path / "nosys").startswith("a CPU quota of 0.25 cores (cgroup /docker/c1)")
    (proc / "mountinfo").write_bytes(b"30 23 0:28 / /\xff rw - cgroup2 cgroup2 rw\n")  # not UTF-8
    assert hazards([0], proc=proc, sysfs=tmp_path / "nosys") == ""


def test_hazards_name_hyperthread_siblings_among_the_spinners_cpus(tmp_path):
    proc = fake_machine(tmp_path, cgroup="0::/\n", mounts=[], files={
        f"sys/cpu{cpu}/topology/thread_siblings_list": siblings for cpu, siblings in
        {0: "0,2\n", 1: "1,3\n", 2: "0,2\n", 3: "1,3\n", 4: "4-5\n", 5: "4-5\n"}.items()
    })
    assert hazards([0, 1, 2, 4, 5], proc=proc, sysfs=tmp_path / "sys") == "hyperthread siblings 0+2, 4+5: a spinner shares the computing worker's core"
    assert hazards([0, 1, 4], proc=proc, sysfs=tmp_path / "sys") == ""  # one CPU of each core


def test_a_daemon_under_a_quota_says_so_when_it_starts_and_in_status(serve, fake_model, monkeypatch):
    said = "a CPU quota of 1 core (cgroup /x): the spinners' time counts against it"
    monkeypatch.setattr("kvpool.daemon.keep_warm.hazards", lambda cpus: said)
    daemon = serve(fake_model, "--keep-warm", "60")
    assert f"--keep-warm: {said} (spinning all the same; --keep-warm 0 turns it off)" in daemon.lines
    assert daemon.supervisor.service.keep_warm.pids()  # warned, not refused
    with daemon.client() as client:
        assert f"hazards: {said}" in client.stats().keep_warm
    assert KeepWarm(0.0).hazards == ""

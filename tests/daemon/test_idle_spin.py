"""--idle-spin on real workers of the bundled model at 2 llama threads a worker (an OpenMP team): each worker
sets GOMP_SPINCOUNT in its environment before llama.cpp loads, as --idle-spin says, unless the daemon was
started with one of its own (or OMP_WAIT_POLICY), which is kept; `kvpool status` says which applies. What
libgomp itself read is taken from libgomp: OMP_DISPLAY_ENV=verbose makes it print its settings as it loads, into
the daemon's log (the workers' stderr). How long threads wait changes no arithmetic: the logits are the same bits."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.support.daemons import START_HANG_GUARD_S, DaemonProcess
from workers.server.spin import DEFAULT_IDLE_SPIN, SPIN_COUNT

TWO_THREADS = ("--threads", "2", "--threads-per-worker", "2", "--n-ctx", "64", "--max-sessions", "1", "--calibration-cache", "off")
TOKENS = [1, 50, 60, 70, 80, 90, 100, 110, 120]


def _libgomp_read(log: str) -> list[str]:
    """The GOMP_SPINCOUNT values libgomp printed as it loaded (OMP_DISPLAY_ENV=verbose), process by process in the
    log's order."""
    return re.findall(r"GOMP_SPINCOUNT = '(\d+)'", log)


def test_workers_spin_as_told_and_keep_the_users_own_setting(model_path, socket_dir, monkeypatch):
    monkeypatch.delenv(SPIN_COUNT, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "verbose")
    runs = {"default": (), "flag": ("--idle-spin", "2500"), "environment": ("--idle-spin", "2500")}
    seen, outputs = {}, {}
    for name, options in runs.items():
        if name == "environment":
            monkeypatch.setenv(SPIN_COUNT, "777")  # the daemon's environment, inherited by what it spawns
        daemon = DaemonProcess(model_path, socket_dir / f"spin-{name}.sock", *TWO_THREADS, *options)
        try:
            with daemon.client() as client:
                stats = client.stats()
                outputs[name] = [client.append("s", 1, 0, tokens=TOKENS[:8]).rows, client.append("s", 1, 8, tokens=TOKENS[8:]).rows]
        finally:
            assert daemon.stop() == 0
        log = daemon.log_path.read_text()
        seen[name] = (stats.threads_detail, _libgomp_read(log), "workers' idle llama threads spin as the environment says" in log)
    spins = "2 llama threads a worker; idle threads spin "
    assert seen["default"][0] == spins + f"{DEFAULT_IDLE_SPIN} times before they sleep (GOMP_SPINCOUNT={DEFAULT_IDLE_SPIN})"
    assert seen["flag"][0] == spins + "2500 times before they sleep (GOMP_SPINCOUNT=2500)"
    assert seen["environment"][0] == spins + "as the environment says (GOMP_SPINCOUNT=777; --idle-spin not applied)"
    # the worker's libgomp is the last to print (the supervisor, where it loads llama.cpp's bindings, prints first,
    # with libgomp's default or the environment's; it runs no llama thread)
    for name, expected, supervisor in (("default", str(DEFAULT_IDLE_SPIN), "300000"), ("flag", "2500", "300000"), ("environment", "777", "777")):
        read = seen[name][1]
        assert read and read[-1] == expected and set(read) <= {expected, supervisor}, (name, read)
    assert [seen[name][2] for name in runs] == [False, False, True]  # a flag the environment overrides is said at start-up
    for name in ("flag", "environment"):
        for theirs, ours in zip(outputs[name], outputs["default"]):
            np.testing.assert_array_equal(theirs, ours)


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_idle_spin_stops_the_daemon_with_exit_2(model_path, socket_dir, value):
    from kvpool.launcher import Daemon

    daemon = Daemon(model_path, socket_dir / "spin-bad.sock", [*TWO_THREADS, "--idle-spin", value])
    assert daemon.process.wait(timeout=START_HANG_GUARD_S) == 2  # a hang guard: the arguments are refused as they are read
    daemon.stop()
    assert "idle-spin" in daemon.log_path.read_text()

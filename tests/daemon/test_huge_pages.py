"""--huge-pages on real workers (the bundled model's middle shard): by default a worker starts with glibc's malloc
asking for transparent huge pages where this machine's kernel offers them (its environment names the tunable; with
glibc >= 2.35 its buffers then sit in huge pages, which `kvpool status` shows), with `off` it starts with the
supervisor's environment; the logits are the same bits either way."""

from __future__ import annotations

import platform

import numpy as np

from kvpool.host import GLIBC_TUNABLES_ENV, asks_for_huge_pages, huge_page_environment
from tests.support.daemons import DaemonProcess

ONE_PLACE = ("--threads", "1", "--n-ctx", "64", "--max-sessions", "1", "--calibration-cache", "off")


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        items = [item.decode(errors="replace") for item in environ.read().split(b"\0") if item]
    return dict(item.split("=", 1) for item in items if "=" in item)


def _glibc_reads_the_tunable() -> bool:
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(part) for part in version.split(".")[:2]) >= (2, 35)


def _worker_environments(daemon: DaemonProcess, stats) -> list[dict[str, str]]:
    pids = {worker.pid for worker in stats.workers}
    assert pids and pids <= set(daemon.worker_pids())
    return [_environment(pid) for pid in sorted(pids)]


def test_workers_ask_for_huge_pages_where_offered_and_not_with_off(shards, socket_dir):
    middle = shards[1]
    rows = (np.random.default_rng(7).standard_normal((9, middle.shape.n_embd)) * 0.1).astype(np.float32)
    wanted = huge_page_environment().get(GLIBC_TUNABLES_ENV, "")  # what this machine's kernel and environment give
    outputs = {}
    for setting in ("auto", "off"):
        daemon = DaemonProcess(middle.path, socket_dir / f"huge-{setting}.sock", *ONE_PLACE, "--huge-pages", setting)
        try:
            with daemon.client() as client:
                stats = client.stats()
                outputs[setting] = [client.append("s", 1, 0, hidden=rows[:8]).rows, client.append("s", 1, 8, hidden=rows[8:]).rows]
            environments = _worker_environments(daemon, stats)
        finally:
            assert daemon.stop() == 0
        asked = setting == "auto" and asks_for_huge_pages(wanted)
        for environment in environments:
            assert asks_for_huge_pages(environment.get(GLIBC_TUNABLES_ENV, "")) == asked, environment.get(GLIBC_TUNABLES_ENV)
        if asked:
            assert stats.huge_pages.startswith("workers' malloc asks for them")
            if _glibc_reads_the_tunable():
                assert all(worker.huge_page_bytes > 0 for worker in stats.workers), [worker.huge_page_bytes for worker in stats.workers]
        else:
            assert stats.huge_pages.startswith("off (")
    for auto, off in zip(outputs["auto"], outputs["off"]):
        np.testing.assert_array_equal(auto, off)  # same bits: where the buffers sit changes no arithmetic

"""The start-up probe's readings kept between runs (README, "Memory"): a daemon started again on the same shard,
build, mode, context size and thread count on the same machine takes its charges from the readings its
predecessor measured instead of filling a context again, so a rolling restart is ready once its workers have
loaded. Kept in the user's cache (--calibration-cache user, the default: kvpool/calibration in $XDG_CACHE_HOME or
~/.cache, kvpool.host.user_cache_dir) or in --calibration-cache DIR; one file per key, written under a temporary
name and renamed. A file that does not decode, or names another key, is measured again
and replaced."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import platform
import time

import msgspec

from kvpool.state.header import StateIdentity

FORMAT = 1


class ProbeKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the probe's readings depend on: the shard's state identity (its file, layers, the llama.cpp build, the
    cache's types and layout), the mode, the largest context, the threads a worker computes with, the machine,
    whether the workers' loaded weights sit in huge pages (--huge-pages: the step time differs) and, for workers of
    more than one thread, how their idle threads spin (--idle-spin or the environment: the step time differs)."""

    format: int
    identity: StateIdentity
    mode: str
    n_ctx: int
    worker_threads: int
    n_gpu_layers: int
    machine: str
    kvpool_probe: str  # the probe's own parameters (kvpool.daemon.admission.calibration): another probe, another key
    huge_pages: bool = False  # --huge-pages auto: the weights collapsed into huge pages after the load
    idle_spin: str = ""  # a worker's idle spin as it reported it (workers.server.spin.set_idle_spin); "" at 1 thread


class CachedProbe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: ProbeKey
    n_ctx: int
    filled: tuple[tuple[int, int], ...]
    step_s: float | None
    measured_at: float  # wall-clock seconds


def machine_name() -> str:
    """The host and its CPU model: readings of one machine say nothing of another's allocator or speed."""
    model = ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{platform.node()} {model or platform.processor() or platform.machine()} {os.cpu_count()} cpus"


class ProbeCache:
    def __init__(self, directory: pathlib.Path, key: ProbeKey) -> None:
        self.directory = directory
        self.key = key
        digest = hashlib.sha256(msgspec.json.encode(key)).hexdigest()[:24]
        self.path = directory / f"probe-{digest}.json"

    def load(self) -> CachedProbe | None:
        """The readings kept for this key, or None (none, unreadable, or another key's)."""
        try:
            cached = msgspec.json.decode(self.path.read_bytes(), type=CachedProbe)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return cached if cached.key == self.key else None

    def store(self, n_ctx: int, filled: tuple[tuple[int, int], ...], step_s: float | None) -> bool:
        """Keep the readings; False when they could not be written (the daemon runs on without)."""
        data = msgspec.json.encode(CachedProbe(self.key, n_ctx, filled, step_s, time.time()))
        partial = self.path.with_name(self.path.name + ".partial")
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            partial.write_bytes(data)
            os.replace(partial, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink()
            return False
        return True

"""Shared recording: operations, latencies and errors (Recorder), stats samples of every daemon (Sampler)."""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvpool.client.client import Client, ConnectionLost, KvpoolError
from kvpool.stress.report import Latency, Sample

# ---- shared recording --------------------------------------------------------------------------------------


class Recorder:
    """Latencies, error replies and events from every session thread (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latencies: dict[str, list[float]] = {}
        self.errors: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.ops_done = 0

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed_ms = (time.perf_counter() - started) * 1000
            with self._lock:
                self._latencies.setdefault(kind, []).append(elapsed_ms)

    def error(self, error: KvpoolError) -> None:
        key = f"{error.code}/{error.reason}" if error.reason else str(error.code)
        with self._lock:
            self.errors[key] += 1

    def event(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.events[name] += amount

    def op_done(self) -> None:
        with self._lock:
            self.ops_done += 1

    def error_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self.errors.items()))

    def event_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self.events.items()))

    def latency_summary(self) -> dict[str, Latency]:
        with self._lock:
            items = {kind: list(values) for kind, values in self._latencies.items()}
        summary = {}
        for kind, values in sorted(items.items()):
            p50, p90, p99 = np.percentile(values, [50, 90, 99])
            summary[kind] = Latency(len(values), round(float(p50), 3), round(float(p90), 3), round(float(p99), 3), round(max(values), 3))
        return summary


class Sampler:
    """Polls every daemon's stats from its own thread and connections every `interval_s`.

    A daemon for which `expected_loss(index)` is true (its supervisor was killed by the drill) may be
    unreachable for a while: those samples are skipped (counted in `gaps`) and the connection reopened.
    """

    def __init__(self, sockets: Sequence[pathlib.Path], interval_s: float, expected_loss: Callable[[int], bool] | None = None) -> None:
        self._sockets = list(sockets)
        self._interval_s = interval_s
        self._expected_loss = expected_loss or (lambda index: False)
        self._stop = threading.Event()
        self._started = time.monotonic()
        self.samples: list[Sample] = []
        self.failures: list[str] = []
        self.gaps = 0
        self._thread = threading.Thread(target=self._run, name="kvpool-stress-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def latest(self) -> dict[int, Sample]:
        latest: dict[int, Sample] = {}
        for sample in self.samples[-2 * len(self._sockets) :]:
            latest[sample.daemon] = sample
        return latest

    def _sample(self, index: int, client: Client) -> None:
        stats = client.stats()
        self.samples.append(
            Sample(
                t_s=round(time.monotonic() - self._started, 3), daemon=index,
                reserved_bytes=stats.budget.reserved_bytes + stats.budget.spare_bytes, limit_bytes=stats.budget.limit_bytes,  # the budget's whole
                measured_uss_bytes=stats.budget.measured_uss_bytes, sessions=len(stats.sessions),
                integrity=stats.integrity,
            )
        )

    def _run(self) -> None:
        clients: list[Client | None] = [None] * len(self._sockets)
        try:
            while True:
                for index, path in enumerate(self._sockets):
                    try:
                        if clients[index] is None:
                            clients[index] = Client(path, timeout_s=30, name="stress-sampler")
                        self._sample(index, clients[index])
                    except ConnectionLost:
                        if not self._expected_loss(index):
                            raise
                        self.gaps += 1
                        if clients[index] is not None:
                            clients[index].close()
                        clients[index] = None
                if self._stop.wait(self._interval_s):
                    return
        except (ConnectionLost, KvpoolError, OSError) as error:
            self.failures.append(f"sampler stopped: {error}")
        finally:
            for client in clients:
                if client is not None:
                    client.close()

"""Counters and gauges of one daemon, readable as a dict (stats replies) and as Prometheus text."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

COUNTERS = (
    "appends",
    "append_rows",
    "admissions",
    "admissions_queued",
    "hits",
    "misses",
    "evictions",
    "expirations",
    "stale_epoch_rejects",
    "cancels",
    "worker_restarts",
    "over_budget_rejects",
    "bad_requests",
    "releases",
    "truncates",
    "spills",
    "spill_drops",
    "spill_disk_failures",  # disk-tier file operations that failed (a failed write drops the state it was to hold)
    "restores",
    "restores_into_spare",  # restores into the spare context a park or a release left on the worker (none created)
    "restores_in_place",  # of those, into the spare of the session's own park, unzeroed: its cells kept, nothing loaded
    "spares_freed",  # spare contexts freed to make room for an admission
    "spares_kept",  # released sessions' contexts kept as their workers' spares (a release, a newer epoch; process mode)
    "spares_expired",  # spare contexts freed because no admission took them within --ttl
    "admissions_into_spare",  # admissions whose context was the worker's spare (a park's or a release's, zeroed first): none created
    "restore_failures",
    "restore_requests",  # parked sessions made hot by a Restore request (before their next append; counted in restores too)
    "parks",
    "forks",
    "exports",  # exports started (Export at offset 0: a state saved)
    "export_chunks",  # Exported replies
    "imports",  # imports completed: sessions admitted parked
    "import_chunks",  # Import chunks taken
    "direct_cancels_forwarded",
    "calibrations",  # charge measurements: at start-up only (an admission never measures)
    "calibrations_cached",  # start-ups that took the probe's readings kept by an earlier run (--calibration-cache)
    "calibration_cache_failures",  # readings that could not be kept (the daemon runs on without)
    "adopted",  # parked sessions taken over at start-up from the --spill-dir files of an earlier run
    "persisted",  # copies of hot sessions written behind to the disk tier (--persist-after)
    "persist_failures",  # copies not written (no room beside the parked states, a failed write or save)
    "drains",  # drains started (SIGTERM, Shutdown{drain: true}: kvpool.daemon.drain)
    "drain_parked",  # sessions a drain left parked (on disk with a disk tier)
    "drain_dropped",  # sessions a drain could not keep
    "prefix_lookups",  # PrefixLookup requests answered
    "prefix_hits",  # sessions admitted from a stored prefix (AdmitPrefix)
    "prefix_hit_tokens",  # positions those sessions did not compute
    "prefix_misses",  # prefix admissions refused: the store no longer held the prefix (cache_miss prefix_evicted)
    "prefix_stored",  # prefixes stored (offers of blocks the store did not hold)
    "prefix_evictions",  # stored prefixes pushed out for room
    "prefix_adopted",  # stored prefixes taken over at start-up from --spill-dir/prefixes
)


class Metrics:
    """One owner of every count; `snapshot()` for stats, `serve_http(port)` for Prometheus scrapes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._values: collections.Counter[str] = collections.Counter()
        self._counters = {
            name: Counter(f"kvpool_{name}", f"kvpool {name.replace('_', ' ')}", registry=self.registry)
            for name in COUNTERS
        }
        self._misses = Counter(
            "kvpool_cache_misses_by_reason", "cache misses by reason", ["reason"], registry=self.registry
        )
        self._errors = Counter("kvpool_errors_by_code", "error replies by code", ["code"], registry=self.registry)
        self.sessions = Gauge("kvpool_sessions", "live sessions", registry=self.registry)
        self.reserved_bytes = Gauge("kvpool_reserved_bytes", "bytes reserved by live sessions", registry=self.registry)
        self.spare_bytes = Gauge("kvpool_spare_bytes", "bytes kept by free workers' spare contexts (in the budget beside the sessions')", registry=self.registry)
        self.limit_bytes = Gauge("kvpool_budget_bytes", "the byte budget", registry=self.registry)
        self.measured_bytes = Gauge("kvpool_measured_uss_bytes", "USS of all workers", registry=self.registry)
        self.shared_memory_bytes = Gauge(
            "kvpool_shared_memory_bytes", "the workers' shared-memory segments (outside the session budget)", registry=self.registry
        )

        self.spill_bytes = Gauge("kvpool_spill_bytes", "saved session states held, by tier", ["tier"], registry=self.registry)
        self.spill_limit_bytes = Gauge("kvpool_spill_limit_bytes", "the spill store's limits, by tier", ["tier"], registry=self.registry)
        self.prefix_bytes = Gauge("kvpool_prefix_bytes", "bytes of the prefix store's entries", registry=self.registry)
        self.prefix_entries = Gauge("kvpool_prefix_entries", "entries of the prefix store", registry=self.registry)
        self.prefix_blocks = Gauge("kvpool_prefix_blocks", "blocks the prefix store's entries hold", registry=self.registry)
        self._restore_seconds = Histogram(
            "kvpool_restore_seconds", "time to make a parked session hot again (room, read, restore)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0), registry=self.registry,
        )

    def show_books(self, books) -> None:
        """Gauges from the books (kvpool.daemon.books.books.Books), after each change."""
        self.sessions.set(len(books.table))
        self.reserved_bytes.set(books.session_bytes)
        self.spare_bytes.set(books.spare_bytes)
        spill = books.spill
        for tier, held, limit in (("ram", spill.ram_bytes, spill.ram_limit), ("disk", spill.disk_bytes, spill.disk_limit)):
            self.spill_bytes.labels(tier=tier).set(held)
            self.spill_limit_bytes.labels(tier=tier).set(limit)
        self._catch_up("spill_disk_failures", spill.disk_failures + books.prefixes.disk_failures)
        prefixes = books.prefixes
        self.prefix_bytes.set(prefixes.bytes)
        self.prefix_entries.set(len(prefixes))
        self.prefix_blocks.set(prefixes.blocks)
        self._catch_up("prefix_evictions", prefixes.evictions)

    def _catch_up(self, name: str, total: int) -> None:
        """A counter whose running total a part of the books keeps (the spill store's disk failures)."""
        if total > self._values[name]:
            self.count(name, total - self._values[name])

    def observe_restore(self, seconds: float) -> None:
        self.count("restores")
        self._restore_seconds.observe(seconds)

    def count(self, name: str, amount: int = 1) -> None:
        self._values[name] += amount
        self._counters[name].inc(amount)

    def note(self, name: str, value: int) -> None:
        """A value shown with the counters in stats (not a count: e.g. the minimum residency in ms)."""
        self._values[name] = value

    def note_max(self, name: str, value: int) -> None:
        """The largest value seen, shown with the counters in stats (e.g. the longest admission wait in ms)."""
        self._values[name] = max(self._values.get(name, 0), value)

    def count_miss(self, reason: str) -> None:
        self.count("misses")
        self._values[f"misses_{reason}"] += 1
        self._misses.labels(reason=reason).inc()

    def count_error(self, code: str) -> None:
        self._values[f"errors_{code}"] += 1
        self._errors.labels(code=code).inc()

    def snapshot(self) -> dict[str, int]:
        return {name: self._values.get(name, 0) for name in COUNTERS} | {
            key: value for key, value in self._values.items() if key not in COUNTERS
        }

    def serve_http(self, port: int, address: str = "127.0.0.1") -> int:
        """Start the scrape endpoint in a background thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=address, registry=self.registry)
        return server.server_address[1]

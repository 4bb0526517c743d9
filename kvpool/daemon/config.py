"""The daemon's settings: one frozen, validated object (`kvpool serve` builds it from its command line)."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from kvpool.host import available_cores
from kvpool.wire.protocol import DEFAULT_MAX_REQUEST_BYTES
from kvpool.daemon.books.spill import SpillDirRefused, check_disk_dir

DEFAULT_MAX_BUFFERED_BYTES = 256 * 1024**2
DEFAULT_EXPORT_CHUNK_BYTES = 1024**2  # an Exported reply's state bytes: far below any reply frame limit
MIN_EXPORT_CHUNK_BYTES = 1024
DEFAULT_MAX_IMPORT_BYTES = 256 * 1024**2


MODES = ("process", "batched", "auto")  # auto: resolved at start-up (kvpool.daemon.mode_probe) to one of the others


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `kvpool serve` is configured with; validated on construction."""

    model: pathlib.Path
    socket: pathlib.Path
    budget_bytes: int = 1024**3
    max_sessions: int = 4  # also the number of warm worker processes
    ttl_s: float = 300.0
    threads: int = dataclasses.field(default_factory=available_cores)  # llama threads computing at once, all workers
    threads_per_worker: int = 1
    n_ctx: int = 2048  # the largest context a session may ask for, and the default
    flash_attn: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    ready_timeout_s: float = 60.0
    request_timeout_s: float = 600.0  # a worker call not answered by then: worker killed, request worker_lost
    memory_margin_bytes: int = 64 * 1024**2  # measured USS above charge + this -> recycle when idle
    housekeeping_interval_s: float = 0.5
    # An idle session that appended less than this long ago is not evicted by an admission, which waits for
    # the protection to lapse instead (kvpool.daemon.admission.residency). None: derived from the step time measured at
    # start-up, a few of this route's steps (kvpool.daemon.admission.residency.derived_min_residency_s).
    min_residency_s: float | None = None
    admit_queue_limit: int = 64  # admissions waiting for room at once; one more is answered over_budget
    metrics_port: int | None = None
    n_gpu_layers: int = 0
    verbose: bool = False
    spill_budget_bytes: int | None = None  # the warm tier's memory limit; None: equal to budget_bytes, 0: off
    park_after_s: float = 0.0  # park hot sessions idle this long (0: only when their place is needed)
    persist_after_s: float | None = None  # copy hot sessions idle this long to the disk tier (None: never)
    spill_dir: pathlib.Path | None = None  # the disk tier (opt-in, with spill_disk_budget_bytes)
    spill_disk_budget_bytes: int = 0
    direct: bool = True  # each worker offers a direct channel to clients that ask for it (process mode)
    # "process": one worker process per session; "batched": a worker process holds seqs_per_worker sessions
    # as sequences of one context and decodes their appends together (kvpool.daemon.pool.batched)
    mode: str = "process"
    seqs_per_worker: int = 4
    # Session ids whose highest epoch is remembered besides the live ones; past it the lowest epoch is
    # forgotten and the epoch floor rises to it (kvpool.daemon.books.sessions: the fencing rule).
    fence_ids: int = 65536
    # The socket transport (kvpool.daemon.transport.frames): a connection's Hello must arrive whole within handshake_timeout_s
    # of its accept, and every later frame within frame_timeout_s of its first byte (idle between frames: no limit)
    handshake_timeout_s: float = 10.0
    frame_timeout_s: float = 30.0
    max_buffered_bytes: int | None = None  # request bytes held across all connections; None: DEFAULT_MAX_BUFFERED_BYTES or one largest frame
    max_connections: int | None = None  # None: derived at start-up from RLIMIT_NOFILE (kvpool.daemon.transport.frames.derived_max_connections)
    # A drain (SIGTERM, Shutdown{drain: true}: kvpool.daemon.drain) lets requests in flight finish this long,
    # then cancels the appends still computing, parks every hot session and exits
    drain_timeout_s: float = 30.0
    # Export / Import (kvpool.daemon.transfer): the state bytes of one Exported reply, and the bytes one
    # import may total (all imports in progress together as well); an import must also fit the spill store
    export_chunk_bytes: int = DEFAULT_EXPORT_CHUNK_BYTES
    max_import_bytes: int = DEFAULT_MAX_IMPORT_BYTES

    def __post_init__(self) -> None:
        problems = []
        if self.budget_bytes <= 0:
            problems.append("--budget must be positive")
        if self.max_sessions < 1:
            problems.append("--max-sessions must be at least 1")
        if self.ttl_s <= 0:
            problems.append("--ttl must be positive")
        if self.threads_per_worker < 1 or self.threads < self.threads_per_worker:
            problems.append("--threads must be at least --threads-per-worker (>= 1)")
        if self.request_timeout_s <= 0:
            problems.append("--request-timeout must be positive")
        if self.housekeeping_interval_s <= 0:
            problems.append("--housekeeping-interval must be positive")
        if self.min_residency_s is not None and self.min_residency_s < 0:
            problems.append("--min-residency must be >= 0")
        if self.fence_ids < 1:
            problems.append("--fence-ids must be at least 1")
        if self.admit_queue_limit < 1:
            problems.append("--admit-queue must be at least 1")
        if self.n_ctx < 16:
            problems.append("--n-ctx must be at least 16")
        if self.max_request_bytes < 1024:
            problems.append("--max-request-bytes must be at least 1024")
        if self.spill_budget_bytes is not None and self.spill_budget_bytes < 0:
            problems.append("--spill-budget must be >= 0")
        if self.park_after_s < 0:
            problems.append("--park-after must be >= 0")
        if self.persist_after_s is not None and (self.persist_after_s < 0 or self.spill_dir is None):
            problems.append("--persist-after needs --spill-dir and must be >= 0")
        if (self.spill_dir is None) != (self.spill_disk_budget_bytes == 0):
            problems.append("--spill-dir and --spill-disk-budget go together")
        if self.spill_dir is not None:
            try:
                check_disk_dir(self.spill_dir)  # before any worker starts
            except SpillDirRefused as refused:
                problems.append(str(refused))
        if self.mode not in MODES:
            problems.append(f"--mode must be one of {', '.join(MODES)}")
        if self.mode in ("batched", "auto") and not (1 <= self.seqs_per_worker <= 256 and self.max_sessions % self.seqs_per_worker == 0):
            problems.append("--seqs-per-worker must be in [1, 256] and divide --max-sessions")
        if self.handshake_timeout_s <= 0:
            problems.append("--handshake-timeout must be positive")
        if self.frame_timeout_s <= 0:
            problems.append("--frame-timeout must be positive")
        if self.max_buffered_bytes is not None and self.max_buffered_bytes < self.max_request_bytes:
            problems.append("--max-buffered-bytes must be at least --max-request-bytes")
        if self.max_connections is not None and self.max_connections < 1:
            problems.append("--max-connections must be at least 1")
        if self.export_chunk_bytes < MIN_EXPORT_CHUNK_BYTES:
            problems.append(f"--export-chunk-bytes must be at least {MIN_EXPORT_CHUNK_BYTES}")
        if self.max_import_bytes < 1:
            problems.append("--max-import-bytes must be at least 1")
        if self.drain_timeout_s < 0:
            problems.append("--drain-timeout must be >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append("--metrics-port must be in [0, 65535]")
        if len(os.fsencode(self.socket)) >= 108:
            problems.append(f"socket path too long for a Unix socket (max 107 bytes): {self.socket}")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def defaults(cls) -> dict[str, object]:
        """Every field's default, by field name (the command line reads its defaults from here)."""
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                values[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                values[field.name] = field.default_factory()
        return values

    @property
    def spill_limit_bytes(self) -> int:
        return self.budget_bytes if self.spill_budget_bytes is None else self.spill_budget_bytes

    @property
    def buffered_request_limit_bytes(self) -> int:
        if self.max_buffered_bytes is not None:
            return self.max_buffered_bytes
        return max(DEFAULT_MAX_BUFFERED_BYTES, self.max_request_bytes)

    @property
    def batched(self) -> bool:
        return self.mode == "batched"

    @property
    def worker_processes(self) -> int:
        return self.max_sessions // self.seqs_per_worker if self.batched else self.max_sessions

    @property
    def uses_direct_channels(self) -> bool:
        return self.direct and not self.batched

    @property
    def worker_threads(self) -> int:
        """llama threads of one worker process: --threads-per-worker, or in batched mode --threads shared
        among the worker processes (each computes every one of its sessions' rows in one decode)."""
        return max(1, self.threads // self.worker_processes) if self.batched else self.threads_per_worker

    @property
    def concurrent_workers(self) -> int:
        """How many workers may compute at the same time without exceeding --threads."""
        return max(1, self.threads // self.worker_threads)

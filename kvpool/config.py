"""Configuration: the one place environment variables are read, and the daemon's settings object."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from kvpool.protocol import DEFAULT_MAX_REQUEST_BYTES
from kvpool.spill import SpillDirRefused, check_disk_dir

WORK_DIR_ENV = "KVPOOL_WORK_DIR"
DEFAULT_WORK_DIR = ".kvpool"
FRAME_DEADLINE_ENV = "KVPOOL_DIRECT_FRAME_DEADLINE_S"
DEFAULT_MAX_BUFFERED_BYTES = 256 * 1024**2


def work_dir() -> pathlib.Path:
    """Where generated shards, sockets and benchmark output go (git-ignored in the repository)."""
    return pathlib.Path(os.environ.get(WORK_DIR_ENV) or DEFAULT_WORK_DIR).resolve()


def direct_frame_deadline_s(default: float) -> float:
    """How long a frame on a worker's direct channel may take to pass whole: `default`, or the seconds
    KVPOOL_DIRECT_FRAME_DEADLINE_S names (a positive number; anything else is a ValueError)."""
    text = os.environ.get(FRAME_DEADLINE_ENV, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{FRAME_DEADLINE_ENV} must be a positive number of seconds, not {text!r}")
    return value


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def parse_bytes(text: str) -> int:
    """'1GiB', '512MiB', '2G', '1000000' -> bytes (binary and decimal suffixes; case-insensitive)."""
    units = {
        "": 1, "b": 1,
        "k": 1000, "kb": 1000, "kib": 1024,
        "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
        "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
        "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
    }
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = cleaned[len(number):]
    if not number or unit not in units:
        raise ValueError(f"not a byte size: {text!r} (examples: 1GiB, 512MiB, 2000000)")
    value = float(number) * units[unit]
    if value <= 0:
        raise ValueError(f"byte size must be positive: {text!r}")
    return int(value)


def format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


MODES = ("process", "batched", "auto")  # auto: resolved at start-up (kvpool.mode_probe) to one of the others


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
    # the protection to lapse instead (kvpool.residency). None: derived from the step time measured at
    # start-up, a few of this route's steps (kvpool.residency.derived_min_residency_s).
    min_residency_s: float | None = None
    admit_queue_limit: int = 64  # admissions waiting for room at once; one more is answered over_budget
    metrics_port: int | None = None
    n_gpu_layers: int = 0
    verbose: bool = False
    spill_budget_bytes: int | None = None  # the warm tier's memory limit; None: equal to budget_bytes, 0: off
    park_after_s: float = 0.0  # park hot sessions idle this long (0: only when their place is needed)
    spill_dir: pathlib.Path | None = None  # the disk tier (opt-in, with spill_disk_budget_bytes)
    spill_disk_budget_bytes: int = 0
    direct: bool = True  # each worker offers a direct channel to clients that ask for it (process mode)
    # "process": one worker process per session; "batched": a worker process holds seqs_per_worker sessions
    # as sequences of one context and decodes their appends together (kvpool.batched_worker)
    mode: str = "process"
    seqs_per_worker: int = 4
    # Session ids whose highest epoch is remembered besides the live ones; past it the lowest epoch is
    # forgotten and the epoch floor rises to it (kvpool.sessions: the fencing rule).
    fence_ids: int = 65536
    # The socket transport (kvpool.server): a connection's Hello must arrive whole within handshake_timeout_s
    # of its accept, and every later frame within frame_timeout_s of its first byte (idle between frames: no limit)
    handshake_timeout_s: float = 10.0
    frame_timeout_s: float = 30.0
    max_buffered_bytes: int | None = None  # request bytes held across all connections; None: DEFAULT_MAX_BUFFERED_BYTES or one largest frame
    max_connections: int | None = None  # None: derived at start-up from RLIMIT_NOFILE (kvpool.server.derived_max_connections)

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

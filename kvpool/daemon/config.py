"""The daemon's settings: one frozen, validated object (`kvpool serve` builds it from its command line).

Each setting is written once, as a field of ServeConfig: its type and default, and, for what the command line
sets, its flag, help and parser (`flag`, read by kvpool.cli.serve to define the flags, parse them and take
the --config file's keys)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import types
from collections.abc import Callable
from typing import Any

from kvpool.daemon.books.prefixes import SUBDIR as PREFIX_SUBDIR
from kvpool.daemon.books.spill import SpillDirRefused, check_disk_dir
from kvpool.daemon.keep_warm import check_keep_warm
from kvpool.host import available_cores, format_bytes, parse_bytes, user_cache_dir
from kvpool.wire.protocol import DEFAULT_MAX_REQUEST_BYTES
from workers.server.background import BACKGROUND_NICE, MOST_NICE
from workers.server.spin import DEFAULT_IDLE_SPIN, check_idle_spin

DEFAULT_MAX_BUFFERED_BYTES = 256 * 1024**2
DEFAULT_EXPORT_CHUNK_BYTES = 1024**2  # an Exported reply's state bytes: far below any reply frame limit
MIN_EXPORT_CHUNK_BYTES = 1024
DEFAULT_MAX_IMPORT_BYTES = 256 * 1024**2
DEFAULT_PREFIX_BLOCK = 32
MAX_PREFIX_BLOCK = 4096
DEFAULT_PREFIX_CACHE_BYTES = 256 * 1024**2


HUGE_PAGES = ("auto", "off")  # auto: each worker collapses its load's own memory into transparent huge pages where the kernel offers them
MODES = ("process", "batched", "auto")  # auto: resolved at start-up (kvpool.daemon.mode_probe) to one of the others


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one ServeConfig field is set on `kvpool serve`'s command line and in a --config file."""

    name: str  # the long flag, e.g. --n-ctx (its file key: n-ctx)
    help: str  # "{default}" in it is replaced by the default as the command line shows it
    parse: Callable[[Any], Any] | None  # the flag's argument -> the field's value; None: argparse's `type` does it
    shown: Any  # the default the help shows (the field's own, unless it is a placeholder such as None)
    argparse: types.MappingProxyType  # add_argument's type, metavar, choices or action (a --no-X switch: store_false into X)

    @property
    def dest(self) -> str:
        """The parsed arguments' attribute: the flag's name (--n-ctx: n_ctx; --no-direct: direct)."""
        return self.name.removeprefix("--no-").removeprefix("--").replace("-", "_")

    def help_text(self) -> str:
        if self.parse is parse_bytes and isinstance(self.shown, int):
            shown = format_bytes(self.shown)
        elif isinstance(self.shown, float):
            shown = f"{self.shown:g}"
        else:
            shown = str(self.shown)
        return self.help.format(default=shown)


def flag(name: str, help: str, *, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
         parse: Callable[[Any], Any] | None = None, shown: Any = dataclasses.MISSING, **argparse_options: Any) -> Any:
    """A ServeConfig field set by the command-line flag `name` (see Flag)."""
    if shown is dataclasses.MISSING:
        shown = default if default is not dataclasses.MISSING else default_factory()
    metadata = {"flag": Flag(name, help, parse, shown, types.MappingProxyType(argparse_options))}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def bytes_or_zero(text: str) -> int:
    """A byte size, where a bare 0 turns the thing off (parse_bytes wants a unit)."""
    return 0 if text.strip() == "0" else parse_bytes(text)


def flags() -> list[tuple[str, Flag]]:
    """(ServeConfig field, its Flag) for every field the command line sets, in the fields' order."""
    return [(field.name, field.metadata["flag"]) for field in dataclasses.fields(ServeConfig) if "flag" in field.metadata]


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `kvpool serve` is configured with; validated on construction."""

    model: pathlib.Path
    socket: pathlib.Path
    budget_bytes: int = flag('--budget', "bytes all sessions' contexts may reserve, e.g. 1GiB, 512MiB (default {default})", default=1024 ** 3, parse=parse_bytes)
    max_sessions: int = flag('--max-sessions', 'live sessions at most = warm worker processes (default {default})', default=4, type=int)  # also the number of warm worker processes
    ttl_s: float = flag('--ttl', 'seconds an idle session lives, and a spare context no admission takes (default {default})', default=300.0, type=float)
    threads: int = flag('--threads', 'llama threads computing at once across all workers (default: cores available, {default})', default_factory=available_cores, type=int)  # llama threads computing at once, all workers
    threads_per_worker: int = flag('--threads-per-worker', 'process mode: llama threads per worker (default {default}); a batched worker process gets --threads divided by the number of worker processes', default=1, type=int)
    n_ctx: int = flag('--n-ctx', 'largest (and default) context per session (default {default})', default=2048, type=int)  # the largest context a session may ask for, and the default
    idle_spin: int = flag('--idle-spin', "how long a worker's llama.cpp threads, with more than one to a worker, spin waiting before they sleep, in libgomp's spin iterations (GOMP_SPINCOUNT): they wait so at every step's barriers and between steps. Short enough that a worker done with its step leaves the cores to the next shard's worker, the client and the supervisor (libgomp's own default, 300000, kept them spinning well past their step: a 3-daemon route at --threads-per-worker 2 on 2 cores decoded 1.14-1.21x slower at ~1B, 1.5x at the bundled model); 0 sleeps at once, which makes every barrier a trip through the kernel. A GOMP_SPINCOUNT or OMP_WAIT_POLICY in the daemon's environment is kept instead; `kvpool status` says which applies (default {default})", default=DEFAULT_IDLE_SPIN, type=int)
    flash_attn: bool = flag('--flash-attn', 'use flash attention (all shards of a route must agree)', default=False, action='store_true')
    huge_pages: str = flag('--huge-pages', "auto: right after loading the shard, each worker asks the kernel to move the memory the load allocated (the weights llama.cpp repacks for this CPU: Q4_0, Q4_K, IQ4_NL, ...) into transparent huge pages (2 MiB on x86-64; MADV_COLLAPSE, Linux >= 6.1) where it offers them (THP always or madvise), so that a decode step, which reads them all, takes the same time in every process; contexts keep ordinary pages. `kvpool status` shows what the first worker's load asked and the bytes the workers held. off: nothing asked (default {default})", default='auto', choices=HUGE_PAGES)
    keep_warm_s: float = flag('--keep-warm', "seconds after each session request during which the daemon keeps every CPU it may run on busy with an idle-priority spinner (SCHED_IDLE: it runs only when nothing else wants the CPU and yields to any task at once; one spinner a CPU for the kvpool daemons that share a temporary directory), so that the next request's worker, and the client, wake on a running CPU rather than a halted one (a small gain measured for a route of daemons sharing a 2-core VM: kvpool.daemon.keep_warm). For a machine given to the route: under a CPU quota (cgroup cpu.max, a container's --cpus) the spinners' time counts against it, and a spinner on a hyperthread sibling shares the computing worker's core. The CPUs show busy while sessions are active. 0: off (default {default})", default=0.0, type=float, metavar='SECONDS')
    background_nice: int = flag('--background-nice', 'process mode: how much lower a worker runs the saves no caller waits for (a park answered before its save, --park-after, --persist-after), as a nice value over its own, so that the requests being answered take the cores first; it helps daemons that share cores and a scheduling group (started together on one host), and under full load such a save, and what waits for it, takes longer. 0: at the worker\'s own priority (0-19, default {default})', default=BACKGROUND_NICE, type=int)
    max_request_bytes: int = flag('--max-request-bytes', 'largest request frame accepted (default {default})', default=DEFAULT_MAX_REQUEST_BYTES, parse=parse_bytes)
    ready_timeout_s: float = 60.0
    request_timeout_s: float = flag('--request-timeout', 'seconds a worker may take to answer one call (an append of --n-ctx rows included); a worker that does not is killed and replaced, and its request answered worker_lost (default {default})', default=600.0, type=float)  # a worker call not answered by then: worker killed, request worker_lost
    memory_margin_bytes: int = flag('--memory-margin', 'recycle an idle worker whose measured memory exceeds its charge by this (default {default})', default=64 * 1024 ** 2, parse=parse_bytes)  # measured USS above charge + this -> recycle when idle
    housekeeping_interval_s: float = flag('--housekeeping-interval', 'seconds between housekeeping passes: TTL expiry, replacing dead idle workers, memory checks (default {default})', default=0.5, type=float)
    # An idle session that appended less than this long ago is not evicted by an admission, which waits for
    # the protection to lapse instead (kvpool.daemon.admission.residency). None: derived from the step time measured at
    # start-up, a few of this route's steps (kvpool.daemon.admission.residency.derived_min_residency_s).
    min_residency_s: float | None = flag('--min-residency', "an idle session that appended within the last S seconds is not evicted to admit another: the admission waits for it to lapse instead (default: derived at start-up from the measured decode step, a few of the route's steps; 0 turns it off)", default=None, type=float, metavar='S')
    admit_queue_limit: int = flag('--admit-queue', 'admissions that may wait for room at once, served first come first served; one more is answered over_budget with retry_after_s (default {default})', default=64, type=int, metavar='N')  # admissions waiting for room at once; one more is answered over_budget
    metrics_port: int | None = flag('--metrics-port', 'serve Prometheus metrics on 127.0.0.1:PORT', default=None, type=int)
    n_gpu_layers: int = flag('--n-gpu-layers', 'layers to offload to a GPU build of llama.cpp (default {default})', default=0, type=int)
    verbose: bool = flag('--verbose', "show llama.cpp's log", default=False, action='store_true')
    spill_budget_bytes: int | None = flag('--spill-budget', "bytes of parked sessions' saved states kept in memory (the warm tier): an evicted or parked session is restored exactly by its next append instead of a cache miss; 0 turns the tier off (default: equal to --budget)", default=None, parse=bytes_or_zero)  # the warm tier's memory limit; None: equal to budget_bytes, 0: off
    park_after_s: float = flag('--park-after', 'park a session idle this many seconds even when nobody needs its place; 0: only when its place is needed (default {default})', default=0.0, type=float)
    persist_after_s: float | None = flag('--persist-after', "with --spill-dir: write a copy of a hot session's state to the disk tier once it has been idle S seconds (it stays hot; written again after it grows): after a crash the next daemon adopts it, and the router replays only the tokens since (default: never)", default=None, type=float, metavar='S')
    spill_dir: pathlib.Path | None = flag('--spill-dir', "the disk tier: a private directory (created 0700; a symlink or a directory others can write is refused) for saved states pushed out of memory; the store's own files of an earlier run are deleted at start, nothing else (needs --spill-disk-budget)", default=None, parse=pathlib.Path.absolute, type=pathlib.Path)
    spill_disk_budget_bytes: int = flag('--spill-disk-budget', 'bytes of saved states kept in --spill-dir', default=0, parse=parse_bytes)
    direct: bool = flag('--no-direct', "no direct channels: every append goes through the supervisor (by default a client that asks gets its session's worker's channel, and its appends skip the supervisor)", default=True, action='store_false')
    # "process": one worker process per session; "batched": a worker process holds seqs_per_worker sessions
    # as sequences of one context and decodes their appends together (kvpool.daemon.pool.batched)
    mode: str = flag('--mode', 'process: one worker process per session (each its own llama context); batched: each worker process holds --seqs-per-worker sessions as isolated sequences of one context and decodes the appends that arrive together in one batch, through the supervisor (no direct channels); auto: measure both schedules on this shard with --threads at start-up (a few seconds) and run the faster (`kvpool status` says which and why) (default {default})', default='process', choices=MODES)
    seqs_per_worker: int = flag('--seqs-per-worker', 'batched mode: sessions per worker process; must divide --max-sessions (default {default})', default=4, type=int, metavar='N')
    # Session ids whose highest epoch is remembered besides the live ones; past it the lowest epoch is
    # forgotten and the epoch floor rises to it (kvpool.daemon.books.sessions: the fencing rule).
    fence_ids: int = flag('--fence-ids', "session ids whose highest epoch is remembered besides the live sessions' (default {default}); past N the lowest epoch is forgotten and the daemon's epoch floor rises to it: a request for an id it does not know below the floor is refused stale_epoch (the reply names the floor), never admitted", default=65536, type=int, metavar='N')
    # The socket transport (kvpool.daemon.transport.frames): a connection's Hello must arrive whole within handshake_timeout_s
    # of its accept, and every later frame within frame_timeout_s of its first byte (idle between frames: no limit)
    handshake_timeout_s: float = flag('--handshake-timeout', 'a connection whose Hello has not arrived whole S seconds after it connected is closed (default {default})', default=10.0, type=float, metavar='S')
    frame_timeout_s: float = flag('--frame-timeout', 'a frame must arrive whole within S seconds of its first byte, or its connection is closed; a connection idle between frames stays open (default {default})', default=30.0, type=float, metavar='S')
    max_buffered_bytes: int | None = flag('--max-buffered-bytes', 'request bytes held across all connections: a frame that does not fit waits, unread, for room (default {default}, at least --max-request-bytes)', default=None, parse=parse_bytes, shown=DEFAULT_MAX_BUFFERED_BYTES)  # request bytes held across all connections; None: DEFAULT_MAX_BUFFERED_BYTES or one largest frame
    max_connections: int | None = flag('--max-connections', 'open connections at most; one more is answered over_budget and closed (default: what the open-files limit leaves, at most 1024)', default=None, type=int, metavar='N')
    # A drain (SIGTERM, Shutdown{drain: true}: kvpool.daemon.drain) lets requests in flight finish this long,
    # then cancels the appends still computing, parks every hot session and exits
    drain_timeout_s: float = flag('--drain-timeout', 'on SIGTERM (or `kvpool status --drain`) the daemon drains: new requests are answered draining (a client sends them again to the daemon that takes over the socket), requests in flight get S seconds to finish, appends still computing then are cancelled, every hot session is parked (to --spill-dir when given, so the states outlast the process), then it exits 0; a second SIGTERM or a SIGINT stops at once (exit 1); SIGINT before a drain stops at once (default {default})', default=30.0, type=float, metavar='S')
    # Export / Import (kvpool.daemon.transfer): the state bytes of one Exported reply, and the bytes one
    # import may total (all imports in progress together as well); an import must also fit the spill store
    export_chunk_bytes: int = flag('--export-chunk-bytes', 'state bytes per Exported reply: an export travels in chunks of this size (default {default}, at least 1KiB)', default=DEFAULT_EXPORT_CHUNK_BYTES, parse=parse_bytes)
    max_import_bytes: int = flag('--max-import-bytes', 'the largest state an Import may carry, and the bytes all imports in progress may hold together (default {default}); an import must fit the spill store too', default=DEFAULT_MAX_IMPORT_BYTES, parse=parse_bytes)
    calibration_cache: str = flag('--calibration-cache', "where the start-up probe's readings are kept for the next start of the same shard, build, mode, --n-ctx and threads on this machine, which then takes its charges from them instead of filling a context (a rolling restart is ready once its workers load): a directory, user (kvpool/calibration in $XDG_CACHE_HOME or ~/.cache), or off: measured at every start (default {default})", default="user", metavar='DIR|user|off')
    prefix_block: int = flag('--prefix-block', "tokens per block of the prefix store: a shared prefix is reused in whole blocks (every daemon of a route must agree; the router checks) (default {default})", default=DEFAULT_PREFIX_BLOCK, type=int, metavar='N')
    prefix_cache_budget_bytes: int = flag('--prefix-cache-budget', "bytes of the prefix store, a part of the warm tier: the states of prompts' leading blocks, content-addressed, from which a new session of the route starts instead of computing them (README, \"Shared prefixes\"); mirrored in --spill-dir/prefixes with --spill-dir; 0 turns it off, as --spill-budget 0 does (default {default})", default=DEFAULT_PREFIX_CACHE_BYTES, parse=bytes_or_zero)

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
        try:
            check_idle_spin(self.idle_spin)
        except ValueError as error:
            problems.append(str(error))
        if self.request_timeout_s <= 0:
            problems.append("--request-timeout must be positive")
        if self.housekeeping_interval_s <= 0:
            problems.append("--housekeeping-interval must be positive")
        try:
            check_keep_warm(self.keep_warm_s)
        except ValueError as error:
            problems.append(str(error))
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
        if not 0 <= self.background_nice <= MOST_NICE:
            problems.append(f"--background-nice must be in [0, {MOST_NICE}]")
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
                check_disk_dir(self.spill_dir, subdirs=(PREFIX_SUBDIR,))  # before any worker starts
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
        if not 1 <= self.prefix_block <= MAX_PREFIX_BLOCK:
            problems.append(f"--prefix-block must be in [1, {MAX_PREFIX_BLOCK}]")
        if self.prefix_cache_budget_bytes < 0:
            problems.append("--prefix-cache-budget must be >= 0")
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
    def calibration_cache_dir(self) -> pathlib.Path | None:
        """Where the probe's readings are kept (kvpool.daemon.admission.probe_cache); None: not kept (off, or `user`
        with no user cache directory)."""
        if self.calibration_cache in ("off", "", None):
            return None
        if self.calibration_cache == "user":
            cache = user_cache_dir()
            return None if cache is None else cache / "calibration"  # no home: measured at every start
        return pathlib.Path(self.calibration_cache).absolute()

    @property
    def prefix_limit_bytes(self) -> int:
        """The prefix store's bytes: none while the warm tier is off (its entries are warm-tier states)."""
        return self.prefix_cache_budget_bytes if self.spill_limit_bytes > 0 else 0

    @property
    def max_prefix_digests(self) -> int:
        """The most block digests a lookup or a prefix admission may name: as many blocks as --n-ctx holds."""
        return self.n_ctx // self.prefix_block

    @property
    def buffered_request_limit_bytes(self) -> int:
        if self.max_buffered_bytes is not None:
            return self.max_buffered_bytes
        return max(DEFAULT_MAX_BUFFERED_BYTES, self.max_request_bytes)

    @property
    def loads_in_huge_pages(self) -> bool:
        """Each worker's load (and the mode probe's) collapses its own memory into huge pages (--huge-pages auto)."""
        return self.huge_pages == "auto"

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

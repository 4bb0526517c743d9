"""The host kvpool runs on: the one place environment variables are read (the work directory, the user's cache
directory, the direct channel's frame deadline, the service manager's notification socket), the cores it may use,
and byte sizes as people write them."""

from __future__ import annotations

import os
import pathlib

WORK_DIR_ENV = "KVPOOL_WORK_DIR"
DEFAULT_WORK_DIR = ".kvpool"
FRAME_DEADLINE_ENV = "KVPOOL_DIRECT_FRAME_DEADLINE_S"
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"  # set by a service manager (systemd Type=notify): see kvpool.daemon.notify
CACHE_HOME_ENV = "XDG_CACHE_HOME"  # the XDG base directory for a user's caches (default ~/.cache)


def work_dir() -> pathlib.Path:
    """Where generated shards, sockets and benchmark output go (git-ignored in the repository)."""
    return pathlib.Path(os.environ.get(WORK_DIR_ENV) or DEFAULT_WORK_DIR).resolve()


def user_cache_dir() -> pathlib.Path | None:
    """kvpool's folder in the user's cache directory ($XDG_CACHE_HOME, else ~/.cache): what can be measured again.
    None when neither names a place (no XDG_CACHE_HOME and no home directory, as for some service accounts)."""
    base = os.environ.get(CACHE_HOME_ENV) or ""
    if os.path.isabs(base):
        return pathlib.Path(base) / "kvpool"
    try:  # XDG: a relative value is ignored
        return pathlib.Path.home() / ".cache" / "kvpool"
    except (RuntimeError, KeyError):
        return None


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


def notify_socket_address() -> str | None:
    """The service manager's notification socket (NOTIFY_SOCKET), or None when nothing asked to be told."""
    return os.environ.get(NOTIFY_SOCKET_ENV) or None


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

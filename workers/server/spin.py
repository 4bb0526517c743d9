"""How long a llama.cpp thread with nothing to do spins before it sleeps, in a worker process.

llama.cpp's CPU backend, as llama-cpp-python builds it on Linux, runs a context's threads as an OpenMP team
(GNU libgomp): the threads wait for each other at a barrier after every graph node, and between two steps
they wait for the next one. libgomp's waiting thread spins GOMP_SPINCOUNT times before it sleeps (default
300,000): a worker that has finished its step keeps its cores busy while the next
shard's worker, the client and the supervisor need them. On a 2-core Xeon a route of 3 daemons at
--threads-per-worker 2 decoded the ~1B model at 55.6-57.2 ms a token with libgomp's default and 47.4-48.7 ms with
10,000 (the whole model in one process: 42.9-44.6; the bundled model 23.7-23.8 and 14.9-15.5 ms; evidence/daemon-overhead/README.md,
"Stop 47"); 0 (sleep at once) makes every barrier a trip through the kernel: slower still. A worker of one
thread has no team and never waits this way: the setting changes nothing there.

libgomp reads its environment once, when it is loaded with llama.cpp: the count is set in the process's
environment before that (a worker's spawn target, before it imports the runtime). A GOMP_SPINCOUNT or
OMP_WAIT_POLICY the process was started with is the user's choice and is kept."""

from __future__ import annotations

import os
import sys
from collections.abc import Container, Mapping, MutableMapping

SPIN_COUNT = "GOMP_SPINCOUNT"
WAIT_POLICY = "OMP_WAIT_POLICY"
DEFAULT_IDLE_SPIN = 10_000
LLAMA_MODULE = "llama_cpp"  # importing it loads libgomp, which has then read its environment
ENVIRONMENT_KEPT = "as the environment says"  # how set_idle_spin's answer begins where the user's setting was kept


def check_idle_spin(count: int) -> int:
    """The one rule of --idle-spin: a count of at least 0 (0: sleep at once)."""
    if count < 0:
        raise ValueError(f"--idle-spin must be >= 0 (got {count})")
    return count


def kept_setting(environ: Mapping[str, str] = os.environ) -> str:
    """The user's own OpenMP wait setting in `environ` (GOMP_SPINCOUNT, OMP_WAIT_POLICY), which is kept; "" where none.
    A daemon's workers inherit its environment: the supervisor asks this of its own."""
    return " ".join(f"{name}={environ[name]}" for name in (SPIN_COUNT, WAIT_POLICY) if name in environ)


def kept_said(kept: str) -> str:
    """How the idle threads spin where the user's setting `kept` (kept_setting) is kept, as status and start-up say it."""
    return f"{ENVIRONMENT_KEPT} ({kept}; --idle-spin not applied)"


def set_idle_spin(count: int, environ: MutableMapping[str, str] = os.environ, loaded: Container[str] = sys.modules) -> str:
    """Have llama.cpp's threads in this process spin `count` times before they sleep; how they spin, said for
    a status line ("idle threads spin ..."). Call before llama.cpp is imported: after, it changes nothing, and
    says so."""
    check_idle_spin(count)
    kept = kept_setting(environ)
    if kept:
        return kept_said(kept)
    if LLAMA_MODULE in loaded:
        return f"as libgomp's default says ({SPIN_COUNT} not set: llama.cpp was loaded first)"
    environ[SPIN_COUNT] = str(count)
    return f"{count} times before they sleep ({SPIN_COUNT}={count})"

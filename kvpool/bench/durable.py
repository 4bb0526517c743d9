"""Section 10, sessions that outlive the daemon (issue 20): on one daemon of the route's first shard with the
disk tier (--spill-dir), the drain time (SIGTERM to exit 0) with N parked sessions and with none, the
adoption time (`kvpool serve` on the same socket and spill dir to its first answered Hello) with N sessions
to adopt and with none, and the first append after a restart (1 token, restored from the disk tier,
answered `restored: true`) against a re-prefill of the same history on a fresh session (what a cache miss
costs: the history, then the same token), at 512 and 2048 tokens.

One round is three lifetimes of a daemon on one socket and spill dir, each ended by a drain:
  1. nothing to adopt: N sessions prefilled and parked; drained (the N states written to disk);
  2. adopts the N; they are released, the long sessions prefilled and left hot; drained (parked during it);
  3. adopts the long sessions: each one's first append, then its re-prefill; all released; drained with none.
A daemon's socket opens only once its start-up work (adoption, the charge probe) is done, so the first
answered Hello is its readiness.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import signal
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.bench.options import DURABLE_N_CTX, EPOCH, BenchOptions, median_of
from kvpool.bench.table import Row, ms
from kvpool.client.client import Client
from kvpool.launcher import Daemon

PARKED_SESSION_TOKENS = 64  # each of the N parked sessions
STOP_HANG_GUARD_S = 1800.0  # a hang guard, never a verdict on speed
DAEMON_OPTIONS = ("--threads", "1", "--threads-per-worker", "1", "--max-sessions", "2", "--ttl", "3600", "--n-ctx", str(DURABLE_N_CTX),
                  "--spill-budget", "512MiB", "--spill-disk-budget", "2GiB", "--drain-timeout", "600")
DRAIN_DONE = re.compile(r"drain done: parked (\d+) sessions on disk, dropped (\d+)")
ADOPTED = re.compile(r"adopted \d+ parked sessions from \S+ \(\d+ positions\)[^\n]*")


class DrainFailed(RuntimeError):
    """A drained daemon did not exit 0 with its "drain done" line."""


class DaemonLifetimes:
    """Daemons started one after another on one socket and spill dir; every one is stopped at close()."""

    def __init__(self, shard: pathlib.Path, socket: pathlib.Path, spill_dir: pathlib.Path) -> None:
        self.shard, self.socket = shard, socket
        self.options = [*DAEMON_OPTIONS, "--spill-dir", str(spill_dir)]
        self._stack = contextlib.ExitStack()

    def start(self) -> tuple[Daemon, float]:
        """A new daemon and the seconds from its launch to its first answered Hello."""
        started = time.perf_counter()
        daemon = Daemon(self.shard, self.socket, self.options)
        self._stack.callback(daemon.stop, sig=signal.SIGINT)
        daemon.wait_ready()
        return daemon, time.perf_counter() - started

    @staticmethod
    def drain(daemon: Daemon) -> tuple[float, str]:
        """SIGTERM, and the seconds until the daemon exited, with its "drain done" line (DrainFailed if
        it did not exit 0 with one)."""
        started = time.perf_counter()
        daemon.process.send_signal(signal.SIGTERM)
        code = daemon.process.wait(STOP_HANG_GUARD_S)
        drain_s = time.perf_counter() - started
        daemon.stop()
        log = daemon.log()
        done = DRAIN_DONE.search(log)
        if code != 0 or done is None:
            raise DrainFailed(f"the drain of {daemon.socket} ended with {code}:\n{log[-4000:]}")
        return drain_s, done.group(0)

    def close(self) -> None:
        self._stack.close()


def _adopted(daemon: Daemon, client: Client) -> dict:
    stats = client.stats()
    line = ADOPTED.search(daemon.log())
    return {"adopted": stats.counters.get("adopted", 0), "disk_sessions": sum(row.tier == "disk" for row in stats.sessions),
            "lengths": {row.session_id: row.length for row in stats.sessions}, "integrity": stats.integrity,
            "line": line.group(0) if line else ""}


def _park_sessions(client: Client, tokens: Sequence[int], names: Sequence[str]) -> None:
    for name in names:
        client.append(name, EPOCH, 0, tokens=list(tokens[:PARKED_SESSION_TOKENS]), n_ctx=PARKED_SESSION_TOKENS * 2)
        client.park(name, EPOCH)


def _restore_vs_reprefill(client: Client, tokens: Sequence[int], length: int, fresh: str) -> dict:
    """The restored session's first append (1 token at `length`), then a fresh session's prefill of the same
    history and the same token; whether their outputs are bit-identical."""
    started = time.perf_counter()
    first = client.append(_long(length), EPOCH, length, tokens=[tokens[length]])
    restore_s = time.perf_counter() - started
    started = time.perf_counter()
    client.append(fresh, EPOCH, 0, tokens=list(tokens[:length]))
    prefill_s = time.perf_counter() - started
    again = client.append(fresh, EPOCH, length, tokens=[tokens[length]])
    reprefill_s = time.perf_counter() - started
    for session in (_long(length), fresh):
        client.release(session, EPOCH)
    return {"restore_s": restore_s, "restored": first.restored, "length_after": first.length, "reprefill_prefill_s": prefill_s,
            "reprefill_s": reprefill_s, "output_identical": bool(np.array_equal(first.rows, again.rows))}


def _long(length: int) -> str:
    return f"bench-durable-long-{length}"


def _one_round(lifetimes: DaemonLifetimes, tokens: Sequence[int], options: BenchOptions, round_index: int) -> dict:
    parked = [f"bench-durable-{round_index}-{index}" for index in range(options.durable_sessions)]
    daemon, ready_empty_s = lifetimes.start()
    with daemon.client(direct=False) as client:
        nothing = _adopted(daemon, client)
        _park_sessions(client, tokens, parked)
    drain_n_s, drain_n_line = lifetimes.drain(daemon)

    daemon, ready_n_s = lifetimes.start()
    with daemon.client(direct=False) as client:
        adopted_n = _adopted(daemon, client)
        for name in parked:
            client.release(name, EPOCH)
        for length in options.durable_lengths:
            client.append(_long(length), EPOCH, 0, tokens=list(tokens[:length]))
    drain_hot_s, drain_hot_line = lifetimes.drain(daemon)

    daemon, ready_long_s = lifetimes.start()
    with daemon.client(direct=False) as client:
        adopted_long = _adopted(daemon, client)
        firsts = {str(length): _restore_vs_reprefill(client, tokens, length, f"bench-durable-fresh-{round_index}-{length}")
                  for length in options.durable_lengths}
    drain_empty_s, drain_empty_line = lifetimes.drain(daemon)
    return {
        "ready_nothing_to_adopt_s": ready_empty_s, "adopted_at_empty_start": nothing["adopted"],
        "drain_parked_s": drain_n_s, "drain_parked_line": drain_n_line,
        "ready_adopting_s": ready_n_s, "adopted": adopted_n["adopted"], "adopted_on_disk": adopted_n["disk_sessions"],
        "adopted_lengths": sorted(set(adopted_n["lengths"].values())), "integrity_after_adoption": adopted_n["integrity"],
        "adopted_line": adopted_n["line"],
        "drain_hot_long_s": drain_hot_s, "drain_hot_long_line": drain_hot_line,
        "ready_adopting_long_s": ready_long_s, "adopted_long": adopted_long["adopted"],
        "drain_nothing_s": drain_empty_s, "drain_nothing_line": drain_empty_line, "first_append": firsts,
    }


def tokens_needed(options: BenchOptions) -> int:
    """The history `measure_durable` takes: its longest length and the next token, and a parked session's."""
    return max(max(options.durable_lengths) + 1, PARKED_SESSION_TOKENS)


def measure_durable(shard: pathlib.Path, tokens: Sequence[int], socket_dir: pathlib.Path, options: BenchOptions,
                    say: Callable[[str], None]) -> dict:
    """`options.durable_rounds` rounds of the three lifetimes on <socket_dir>/durable.sock and <socket_dir>/durable-spill."""
    if len(tokens) < tokens_needed(options):
        raise ValueError(f"durable: {len(tokens)} tokens given, {tokens_needed(options)} needed")
    lifetimes = DaemonLifetimes(shard, socket_dir / "durable.sock", socket_dir / "durable-spill")
    rounds = []
    try:
        for round_index in range(options.durable_rounds):
            rounds.append(_one_round(lifetimes, tokens, options, round_index))
            say(f"durable: round {round_index + 1}/{options.durable_rounds}: drain {rounds[-1]['drain_parked_s']:.2f} s, "
                f"ready adopting {rounds[-1]['adopted']} in {rounds[-1]['ready_adopting_s']:.2f} s")
    finally:
        lifetimes.close()
    return {"shard": shard.name, "daemon_options": lifetimes.options, "sessions": options.durable_sessions, "session_tokens": PARKED_SESSION_TOKENS,
            "lengths": list(options.durable_lengths), "rounds": rounds}


# ---- report -------------------------------------------------------------------------------------------


def _median(durable: dict, key: str) -> float:
    return median_of([one[key] for one in durable["rounds"]])


def _per_session(with_n: float, without: float, sessions: int) -> str:
    return f"{(with_n - without) / sessions * 1e3:+.1f} ms per session"


def summarize_durable(durable: dict) -> tuple[dict, dict, list[Row]]:
    """Section 10's summary (s10_* keys) and table rows; it has no target (a figure, not a goal)."""
    sessions, shard = durable["sessions"], durable["shard"]
    drain, drain_none = _median(durable, "drain_parked_s"), _median(durable, "drain_nothing_s")
    ready, ready_none = _median(durable, "ready_adopting_s"), _median(durable, "ready_nothing_to_adopt_s")
    adopted_all = all(one["adopted"] == one["adopted_on_disk"] == sessions and one["adopted_at_empty_start"] == 0
                      and one["adopted_long"] == len(durable["lengths"]) for one in durable["rounds"])
    summary: dict[str, float | bool] = {"s10_drain_parked_s": drain, "s10_drain_nothing_s": drain_none, "s10_ready_adopting_s": ready,
                                        "s10_ready_nothing_to_adopt_s": ready_none, "s10_drain_hot_long_s": _median(durable, "drain_hot_long_s"),
                                        "s10_adopted_every_session": adopted_all}
    rows = [
        Row("10", f"drain: SIGTERM to exit 0, {sessions} parked sessions of {durable['session_tokens']} tokens written to the disk tier "
                  f"({shard}) / a drain with no session", f"{drain:.2f} s", f"{drain_none:.2f} s", _per_session(drain, drain_none, sessions)),
        Row("10", f"adoption: `kvpool serve` on the same socket and spill dir to its first Hello, adopting {sessions} sessions / "
                  "nothing to adopt", f"{ready:.2f} s", f"{ready_none:.2f} s", _per_session(ready, ready_none, sessions)),
        Row("10", f"drain with the {'- and '.join(map(str, durable['lengths']))}-token sessions hot (parked and written during the drain)",
            f"{summary['s10_drain_hot_long_s']:.2f} s", "", ""),
    ]
    exact = adopted_all
    for length in durable["lengths"]:
        runs = [one["first_append"][str(length)] for one in durable["rounds"]]
        restore, reprefill = median_of([run["restore_s"] for run in runs]), median_of([run["reprefill_s"] for run in runs])
        exact = exact and all(run["restored"] and run["output_identical"] and run["length_after"] == length + 1 for run in runs)
        summary.update({f"s10_first_append_restored_{length}_s": restore, f"s10_reprefill_{length}_s": reprefill,
                        f"s10_reprefill_vs_restored_{length}": reprefill / restore})
        rows.append(Row("10", f"{length}-token session, first append after a restart (1 token, restored from the disk tier) vs a fresh "
                              "session's prefill of the same history + that token (re-prefill: a cache miss)",
                        ms(restore), f"{ms(reprefill)} (prefill {ms(median_of([run['reprefill_prefill_s'] for run in runs]))})",
                        f"{reprefill / restore:.1f}x faster"))
    summary["s10_restored_exactly"] = exact
    rows.append(Row("10", f"every one of the {sessions} parked sessions adopted (on disk), every first append after a restart answered "
                          "restored: true, its output bit-identical to the re-prefilled session's", "yes" if exact else "NO", "", ""))
    return summary, {}, rows

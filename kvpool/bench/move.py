"""Section 11, moving a session instead of replaying it (issue 21): a session on the rig's 3-shard route is
re-planned onto a route with other split points (`moved_split`: 2 shards cut inside the old middle shard,
layers 0:14 and 14:30 on the bundled model) by `kvpool.router.Router.replan` (export from each old daemon,
re-slice for each new daemon's layers, seal with its identity, import under epoch + 1), against a replay: the
same history appended on the new route from position 0 by a fresh session. At 128, 512 and 2048 tokens; the
bytes moved (sealed states imported) are counted by the router; each variant's next append (1 token) gives
the logits compared bit for bit.

The section starts its own five daemons (3 of the old route, 2 of the new, --n-ctx MOVE_N_CTX) and stops
them at its end. Variants alternate round by round; each re-plan is one Router with one live session, so
Router.replan's time is that session's move.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.bench.options import MOVE_N_CTX, BenchOptions, as_mib, median_of
from kvpool.bench.rig import run_interleaved, start_daemons
from kvpool.bench.table import Row, ms
from kvpool.client.client import Client
from kvpool.router.router import Router
from kvpool.shard.header import ShardInfo, file_sha256
from kvpool.shard.ranges import LayerRange

DAEMON_OPTIONS = ["--threads", "1", "--threads-per-worker", "1", "--max-sessions", "2", "--ttl", "3600", "--n-ctx", str(MOVE_N_CTX),
                  "--budget", "2GiB", "--spill-budget", "1GiB"]
MOVE, REPLAY = "move", "replay"


def moved_split(old: Sequence[ShardInfo]) -> list[LayerRange]:
    """Two shards cut inside the old route's middle shard (so no old split point survives): [0, k), [k, total)."""
    middle = old[len(old) // 2].shape
    cut = (middle.layer_start + middle.layer_stop) // 2 - 1
    return [LayerRange(0, cut), LayerRange(cut, middle.total_layers)]


def _moved_once(old: list[Client], new: list[Client], session_id: str, tokens: Sequence[int], length: int) -> dict:
    """Prefill on the old route (not timed), Router.replan onto the new one (timed), then the next append there."""
    router = Router(old)
    session = router.session(session_id)
    session.append(tokens[:length])
    started = time.perf_counter()
    replanned = router.replan(new)
    move_s = time.perf_counter() - started
    started = time.perf_counter()
    logits = session.append(tokens[length : length + 1])
    next_s = time.perf_counter() - started
    session.release()
    counts = router.counts
    moved = replanned.moved.get(session_id)
    return {"s": move_s, "next_append_s": next_s, "logits": logits, "moved": moved is not None and not replanned.failed,
            "exported_bytes": moved.exported_bytes if moved else 0, "imported_bytes": moved.imported_bytes if moved else 0,
            "counted_moves": counts.moves, "counted_moved_bytes": counts.moved_bytes, "counted_replays": counts.replays + counts.tail_replays}


def _replayed_once(new: list[Client], session_id: str, tokens: Sequence[int], length: int) -> dict:
    """The same history appended on the new route from 0 (timed), then the same next append."""
    session = Router(new).session(session_id)
    started = time.perf_counter()
    session.append(tokens[:length])
    replay_s = time.perf_counter() - started
    started = time.perf_counter()
    logits = session.append(tokens[length : length + 1])
    next_s = time.perf_counter() - started
    session.release()
    return {"s": replay_s, "next_append_s": next_s, "logits": logits}


def _measure_length(old: list[Client], new: list[Client], tokens: Sequence[int], length: int, rounds: int, say: Callable[[str], None]) -> dict:
    runs: dict[str, list] = {f"{MOVE}_s": [], f"{MOVE}_next_append_s": [], f"{REPLAY}_s": [], f"{REPLAY}_next_append_s": [],
                             "moved": [], "exported_bytes": [], "imported_bytes": [], "counted_moves": [], "counted_moved_bytes": [],
                             "counted_replays": [], "logits_identical": [], "logits_max_abs_diff": []}
    for round_index, order in run_interleaved(rounds, [MOVE, REPLAY]):
        logits = {}
        for name in order:
            session_id = f"bench-move-{length}-{round_index}-{name}"
            got = _moved_once(old, new, session_id, tokens, length) if name == MOVE else _replayed_once(new, session_id, tokens, length)
            runs[f"{name}_s"].append(got["s"])
            runs[f"{name}_next_append_s"].append(got["next_append_s"])
            if name == MOVE:
                for key in ("moved", "exported_bytes", "imported_bytes", "counted_moves", "counted_moved_bytes", "counted_replays"):
                    runs[key].append(got[key])
            logits[name] = got["logits"]
        runs["logits_identical"].append(bool(np.array_equal(logits[MOVE], logits[REPLAY])))
        runs["logits_max_abs_diff"].append(float(np.max(np.abs(logits[MOVE] - logits[REPLAY]))))
        say(f"move: {length} tokens, round {round_index + 1}/{rounds}: replan {runs[f'{MOVE}_s'][-1]:.2f} s, replay {runs[f'{REPLAY}_s'][-1]:.2f} s")
    return runs


def measure_move(old_shards: Sequence[ShardInfo], new_shards: Sequence[ShardInfo], tokens: Sequence[int], socket_dir: pathlib.Path,
                 options: BenchOptions, say: Callable[[str], None]) -> dict:
    if len(tokens) < max(options.move_lengths) + 1:
        raise ValueError(f"move: {len(tokens)} tokens given, {max(options.move_lengths) + 1} needed")
    plan = {f"move-old{index}": (shard.path, DAEMON_OPTIONS) for index, shard in enumerate(old_shards)}
    plan |= {f"move-new{index}": (shard.path, DAEMON_OPTIONS) for index, shard in enumerate(new_shards)}
    with contextlib.ExitStack() as stack:
        say(f"move: starting {len(plan)} daemons (--n-ctx {MOVE_N_CTX})")
        daemons = start_daemons(plan, socket_dir, stack)
        clients = {name: stack.enter_context(Client(daemon.socket, name="kvpool-bench")) for name, daemon in daemons.items()}
        old = [clients[f"move-old{index}"] for index in range(len(old_shards))]
        new = [clients[f"move-new{index}"] for index in range(len(new_shards))]
        lengths = {length: _measure_length(old, new, tokens, length, options.move_rounds, say) for length in options.move_lengths}
        integrity = [client.stats().integrity for client in clients.values()]
        left = sum(len(client.stats().sessions) for client in clients.values())
    return {"old_route": [str(LayerRange(s.shape.layer_start, s.shape.layer_stop)) for s in old_shards],
            "new_route": [str(LayerRange(s.shape.layer_start, s.shape.layer_stop)) for s in new_shards],
            "shard_sha256": {shard.path.name: file_sha256(shard.path) for shard in [*old_shards, *new_shards]},
            "daemon_options": DAEMON_OPTIONS, "lengths": lengths, "integrity": integrity, "sessions_left": left}


# ---- report -------------------------------------------------------------------------------------------


def summarize_move(move: dict) -> tuple[dict, dict, list[Row]]:
    """Section 11's summary (s11_* keys) and table rows; no target (a figure, not a goal)."""
    old, new = ",".join(move["old_route"]), ",".join(move["new_route"])
    summary: dict[str, float | bool] = {}
    rows: list[Row] = []
    moved_all = move["sessions_left"] == 0 and all(state == "ok" for state in move["integrity"])
    identical = True
    for key, runs in move["lengths"].items():
        length = int(key)
        move_s, replay_s = median_of(runs[f"{MOVE}_s"]), median_of(runs[f"{REPLAY}_s"])
        move_next, replay_next = median_of(runs[f"{MOVE}_next_append_s"]), median_of(runs[f"{REPLAY}_next_append_s"])
        # to the next token: a moved session's context is made by its first append (a restore), a replayed one's by the replay
        move_total = median_of([a + b for a, b in zip(runs[f"{MOVE}_s"], runs[f"{MOVE}_next_append_s"])])
        replay_total = median_of([a + b for a, b in zip(runs[f"{REPLAY}_s"], runs[f"{REPLAY}_next_append_s"])])
        moved_bytes, exported_bytes = median_of(runs["imported_bytes"]), median_of(runs["exported_bytes"])
        moved_all = moved_all and all(runs["moved"]) and all(count == 1 for count in runs["counted_moves"]) and not any(runs["counted_replays"])
        moved_all = moved_all and runs["counted_moved_bytes"] == runs["imported_bytes"] and min(runs["imported_bytes"]) > 0
        identical = identical and all(runs["logits_identical"])
        summary.update({f"s11_move_{length}_s": move_s, f"s11_replay_{length}_s": replay_s, f"s11_replay_vs_move_{length}": replay_s / move_s,
                        f"s11_move_next_append_{length}_s": move_next, f"s11_replay_next_append_{length}_s": replay_next,
                        f"s11_move_to_next_token_{length}_s": move_total, f"s11_replay_to_next_token_{length}_s": replay_total,
                        f"s11_replay_vs_move_to_next_token_{length}": replay_total / move_total,
                        f"s11_moved_bytes_{length}": moved_bytes, f"s11_exported_bytes_{length}": exported_bytes})
        rows.append(Row("11", f"{length}-token session, re-plan {old} -> {new}: Router.replan (export, re-slice, import under epoch + 1; "
                              f"{as_mib(moved_bytes):.2f} MiB imported, {as_mib(exported_bytes):.2f} MiB exported) + the next append vs a replay "
                              "(the history appended on the new route from 0) + the same append",
                        f"{ms(move_total)} (replan {ms(move_s)}; next append, restoring, {ms(move_next)})",
                        f"{ms(replay_total)} (replay {ms(replay_s)}; next append {ms(replay_next)})",
                        f"{replay_total / move_total:.1f}x faster (replan alone {replay_s / move_s:.1f}x)"))
    summary["s11_moved_every_session"] = moved_all
    summary["s11_logits_identical"] = identical
    rows.append(Row("11", "every re-plan moved its session (RecoveryCounts: 1 move, its bytes, 0 replays), books ok on all 5 daemons",
                    "yes" if moved_all else "NO", "", ""))
    rows.append(Row("11", "the next append's logits after the move bit-identical to the replayed session's",
                    "yes" if identical else f"NO (max |diff| {max(d for runs in move['lengths'].values() for d in runs['logits_max_abs_diff']):.3g})", "", ""))
    return summary, {}, rows

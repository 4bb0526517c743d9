"""`kvpool bench --quick` end to end, run once for the module: every section in the table, JSON and PNG written,
numbers sane; the sections on daemons of their own (durable sessions, move, shared prefixes) checked in detail on
that run's JSON; their refusals before any daemon starts; the options' limits.

Behaviour tests: they run real daemons and llama.cpp on the bundled model, but assert no speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import pytest

from kvpool.bench.cli import add_arguments, options_from_args
from kvpool.bench.durable import PARKED_SESSION_TOKENS, measure_durable, summarize_durable
from kvpool.bench.move import measure_move, moved_split, summarize_move
from kvpool.bench.options import DURABLE_N_CTX, MOVE_N_CTX, PREFIX_N_CTX, BenchOptions
from kvpool.bench.table import render_table
from kvpool.shard.ranges import LayerRange
from tests.support.daemons import run_to_completion

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = ("1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QUICK_SYSTEM_TOKENS = 512  # section 12's shared system prompt in the quick run (BenchOptions.quick_run)


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


# A hang guard only, never a test of speed: the quick benchmark takes ~1.5 min on 2 busy Xeon cores and
# could take 15 on a 5x slower machine with other work beside it; this is several times that.
BENCH_HANG_GUARD_S = 3600


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory: pytest.TempPathFactory):
    """One `kvpool bench --quick` run for this module's checks: its stdout and its output folder."""
    out = tmp_path_factory.mktemp("quick-bench") / "bench"
    completed = run_to_completion(  # from the repository root: the shards cut once under .kvpool/ are reused
        [sys.executable, "-m", "kvpool", "bench", "--quick", "--out", str(out)], cwd=REPOSITORY, timeout_s=BENCH_HANG_GUARD_S,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed, out


@pytest.mark.timeout(BENCH_HANG_GUARD_S + 300)
def test_quick_bench_prints_every_section_and_writes_json_and_png(quick_bench) -> None:
    completed, out = quick_bench

    table = [line for line in completed.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| # | measurement | kvpool | reference | ratio | target |")
    sections = {line.split("|")[1].strip() for line in table[2:]}
    assert sections == set(SECTIONS)
    for expected in ("daemon vs the same shard in-process", "3 shard daemons vs the whole model", "four sessions: kvpool whole model",
                     "prefill 512 rows", "admit n_ctx 8192", "admit an n_ctx no spare holds (8189..8191", "release -> bytes available", "LRU eviction + admission",
                     "one session n_ctx 2048: charged", "whole-model daemon USS", "128-token session, 3 daemons: Park on all at once",
                     "512-token session, 3 daemons: Park on all at once", "512-token session, the same with Restore on all at once before the decode", "sessions per GiB, 256 tokens at n_ctx 2048",
                     "overload, warm tier on", "overload, warm tier off",
                     "four sessions: kvpool whole model, 1 daemon, --mode batched", "four sessions: kvpool 3-shard chain, --mode batched",
                     "--mode batched vs --mode process", "--mode auto picks",
                     "first start (nothing kept), middle shard, n_ctx 8192", "first start at n_ctx 8192 / at n_ctx 2048",
                     "restart (readings kept: 0 probes), middle shard, n_ctx 8192", "restart at n_ctx 8192 against the model load + 2 s",
                     "drain: SIGTERM to exit 0, 4 parked sessions", "adoption: `kvpool serve` on the same socket and spill dir",
                     "512-token session, first append after a restart", "2048-token session, first append after a restart",
                     "128-token session, re-plan 0:10,10:20,20:30 -> 0:14,14:30: Router.replan",
                     "512-token session, re-plan 0:10,10:20,20:30 -> 0:14,14:30: Router.replan",
                     "new session, 512-token system prompt + 32-token message, 3 shard daemons, time to first token",
                     "middle shard decode: daemon vs that code-free relay: kvpool's own cost",
                     "3 shard daemons sampling on the last vs that code-free relay: kvpool's own cost"):
        assert any(expected in line for line in table), expected
    assert "greedy tokens identical in all 6 paths | yes" in completed.stdout  # the code-free relay's among them
    assert "bit-identical to the re-prefilled session's | yes" in completed.stdout  # every timed decode restored, none missed
    assert "greedy tokens identical, all at once and 2 at a time, tier on and off | yes" in completed.stdout  # waits, parks, replays change no bit
    assert "bit-identical to the re-prefilled session's | yes" in next(line for line in table if line.startswith("| 10 | every one of the 4 parked"))

    results = json.loads((out / "bench-quick.json").read_text())
    assert {"four_sessions_vs_batched", "four_sessions_batched_vs_process_mode", "daemon_vs_inprocess"} <= set(results["ratios"])
    relay_ratios = ("daemon_vs_relay", "mid_relay_vs_inprocess", "route_vs_relay", "route_relay_vs_whole")  # what the code-free relay explains: no target
    assert all(results["ratios"][key]["target"] is None and results["ratios"][key]["value"] > 0 for key in relay_ratios)
    assert results["table"].strip() == "\n".join(table).strip()
    summary = results["summary"]
    for key, value in summary.items():
        if isinstance(value, bool):
            continue
        assert math.isfinite(value), key
        if key.endswith(("_decode_s", "_prefill_s", "_tok_s", "_vs_runtime", "_vs_batched", "_vs_whole", "_create_8192_s")) or "charged" in key or "theory" in key:
            assert value > 0, (key, value)
    assert all(math.isfinite(number) for number in _numbers(results["mid_shard"]))
    admission = results["admission"]  # every steady admission went into the spare the release before left; none of an unheld n_ctx did
    assert all(admission["admits_into_spare"][key] == len(admission["admit_s"][key]) for key in admission["admit_s"]), admission["admits_into_spare"]
    assert all(admission["creates_into_spare"][key] == 0 and len(admission["create_admit_s"][key]) == results["options"]["repeats"]
               and 0 <= admission["creates_freeing_a_spare"][key] <= results["options"]["repeats"] for key in admission["admit_s"]), admission
    assert all(summary[f"s5_create_admit_{n_ctx}_s"] > 0 for n_ctx in results["options"]["admit_n_ctx"])
    assert all(number > 0 for number in _numbers(results["mid_shard"]["decode_s"]))
    assert all(number > 0 for number in _numbers(results["parallel"]["tokens_per_s"]))
    assert summary["s5_evictions_counted"] == results["options"]["repeats"]
    assert summary["s8_ratio"] > 0 and summary["s8_tokens_identical"]
    assert summary["s8_ratio_tier_off"] > 0 and summary["s8_warm_tier"] and not summary["s8_warm_tier_tier_off"]
    assert all(rate > 0 for chain in results["overload"]["chains"].values() for rates in chain["tokens_per_s"].values() for rate in rates)
    memory = results["memory"]["per_session"]
    for n_ctx in ("512", "2048", "8192"):
        assert memory[n_ctx]["charged_bytes"] >= memory[n_ctx]["theoretical_kv_bytes"] > 0  # charge never below theory
    assert results["memory"]["daemon_uss_bytes"]["4"] > results["memory"]["daemon_uss_bytes"]["0"] > 0
    startup = results["startup"]
    assert startup["probed_cells"] == {"512": 512, "2048": 2048, "8192": 2048}  # the probe fills no more than PROBE_CELLS
    assert all(seconds > 0 for runs in startup["ready_s"].values() for seconds in runs)
    assert startup["charged_bytes"]["8192"] > startup["charged_bytes"]["512"] > 0
    assert startup["restart_charged_bytes"] == startup["charged_bytes"]  # kept readings give the charges a probe gave
    assert all(probes == [0, 0, 0] for probes in startup["restart_probes"].values())  # a restart computes nothing
    assert all(cached == [1, 1, 1] for cached in startup["restart_cached"].values())
    assert all(seconds > 0 for runs in startup["restart_ready_s"].values() for seconds in runs) and min(startup["model_load_s"]) > 0
    ratios = results["ratios"]
    assert ratios["s9_start_growth"]["value"] > 0 and ratios["s9_restart_vs_bound"]["value"] > 0 and ratios["s9_restart_vs_load_bound"]["value"] > 0
    assert ratios["restore_vs_reprefill_512"]["target"] == 100 and ratios["parked_vs_hot_sessions_per_gib"]["target"] == 20
    assert all(ratios[key]["value"] > 0 for key in ("restore_vs_reprefill_128", "restore_vs_reprefill_512", "parked_vs_hot_sessions_per_gib"))
    parked = results["warm"]["parked_vs_hot"]
    assert parked["tiers_after_park"] == ["ram"] * 3 and results["warm"]["integrity"] == ["ok"] * 3
    for blob, theory, hot in zip(parked["parked_bytes_per_daemon"], parked["theoretical_kv_bytes_per_daemon"], parked["hot_bytes_per_daemon"]):
        assert theory <= blob < 1.25 * theory < hot  # a parked session keeps its positions' KV, about nothing more

    assert summary["s10_adopted_every_session"] and summary["s10_restored_exactly"]
    assert all(summary[f"s10_reprefill_vs_restored_{length}"] > 0 for length in (512, 2048))
    assert summary["s11_moved_every_session"] and all(summary[f"s11_moved_bytes_{length}"] > 0 for length in (128, 512))
    assert "| 11 | every re-plan moved its session (RecoveryCounts: 1 move, its bytes, 0 replays), books ok on all 5 daemons | yes |" in completed.stdout
    assert summary["s12_cached_vs_uncached"] > 0
    _check_prefix_section(results, table)

    chart = out / "bench-quick.png"
    assert chart.read_bytes()[:8] == PNG_SIGNATURE
    assert chart.stat().st_size > 10_000


# ---- section 10, on the quick run ----------------------------------------------------------------------


def _options(tmp_path: pathlib.Path, model_path: pathlib.Path, **fields) -> BenchOptions:
    return dataclasses.replace(BenchOptions.quick_run(tmp_path, model_path), **fields)


@pytest.mark.timeout(BENCH_HANG_GUARD_S + 300)
def test_the_durable_section_drains_adopts_every_parked_session_and_restores_the_first_append(quick_bench) -> None:
    """Section 10 as the quick run measures it (4 parked sessions of 64 tokens, histories of 512 and 2048, one
    round): every parked session adopted, each first append after a restart restored and bit-identical."""
    _completed, out = quick_bench
    results = json.loads((out / "bench-quick.json").read_text())
    durable = results["durable"]
    (one,) = durable["rounds"]
    assert one["adopted_at_empty_start"] == 0 and one["adopted"] == one["adopted_on_disk"] == 4 and one["adopted_long"] == 2
    assert one["adopted_lengths"] == [PARKED_SESSION_TOKENS] and one["integrity_after_adoption"] == "ok"
    assert one["adopted_line"].startswith("adopted 4 parked sessions from ") and one["adopted_line"].endswith(f"({4 * PARKED_SESSION_TOKENS} positions)")
    assert one["drain_parked_line"] == "drain done: parked 4 sessions on disk, dropped 0"
    assert one["drain_hot_long_line"] == "drain done: parked 2 sessions on disk, dropped 0"
    assert one["drain_nothing_line"] == "drain done: parked 0 sessions on disk, dropped 0"
    for length in (512, 2048):
        first = one["first_append"][str(length)]
        assert first["restored"] and first["length_after"] == length + 1 and first["output_identical"], length
        assert first["restore_s"] > 0 and first["reprefill_s"] >= first["reprefill_prefill_s"] > 0
    for key in ("ready_nothing_to_adopt_s", "drain_parked_s", "ready_adopting_s", "drain_hot_long_s", "ready_adopting_long_s", "drain_nothing_s"):
        assert one[key] > 0, key

    summary, _ratios, rows = summarize_durable(durable)
    assert summary["s10_adopted_every_session"] and summary["s10_restored_exactly"]
    assert all(math.isfinite(value) for value in summary.values())
    table = render_table(rows)
    assert f"| 10 | drain: SIGTERM to exit 0, 4 parked sessions of {PARKED_SESSION_TOKENS} tokens" in table
    assert "| 10 | 2048-token session, first append after a restart" in table
    assert "bit-identical to the re-prefilled session's | yes |" in table


def test_durable_section_refuses_too_few_tokens_before_starting_a_daemon(shards, tmp_path, model_path):
    options = _options(tmp_path, model_path, durable_lengths=(512,))
    (tmp_path / "sockets").mkdir(mode=0o700)
    with pytest.raises(ValueError, match="512 tokens given, 513 needed"):
        measure_durable(shards[0].path, list(range(512)), tmp_path / "sockets", options, say=lambda _line: None)
    assert not list((tmp_path / "sockets").iterdir())  # no daemon started, no spill dir made


# ---- section 11, on the quick run ----------------------------------------------------------------------


@pytest.mark.timeout(BENCH_HANG_GUARD_S + 300)
def test_the_move_section_replans_through_the_router_with_bytes_moved_and_no_replay(quick_bench, shards) -> None:
    """Section 11 as the quick run measures it (histories of 128 and 512, 3 rounds each): every re-plan one move
    and no replay, its bytes counted, the next logits bit-identical to the replayed session's."""
    assert moved_split(shards) == [LayerRange(0, 14), LayerRange(14, 30)]  # no split point of the even route survives
    _completed, out = quick_bench
    move = json.loads((out / "bench-quick.json").read_text())["move"]
    assert move["old_route"] == ["0:10", "10:20", "20:30"] and move["new_route"] == ["0:14", "14:30"]
    assert len(move["shard_sha256"]) == 5 and all(len(digest) == 64 for digest in move["shard_sha256"].values())
    for length in ("128", "512"):
        runs = move["lengths"][length]
        assert runs["moved"] == [True] * 3 and runs["counted_moves"] == [1] * 3 and runs["counted_replays"] == [0] * 3, length
        assert runs["counted_moved_bytes"] == runs["imported_bytes"] and min(runs["imported_bytes"]) > 0 and min(runs["exported_bytes"]) > 0
        assert runs["logits_identical"] == [True] * 3 and runs["logits_max_abs_diff"] == [0.0] * 3
        assert all(min(seconds) > 0 for key, seconds in runs.items() if key.endswith("_s"))
    assert move["integrity"] == ["ok"] * 5 and move["sessions_left"] == 0  # every session released, old epochs too

    summary, _ratios, rows = summarize_move(move)
    assert summary["s11_moved_every_session"] and summary["s11_logits_identical"]
    assert summary["s11_replay_vs_move_to_next_token_512"] > 0
    table = render_table(rows)
    assert "| 11 | 512-token session, re-plan 0:10,10:20,20:30 -> 0:14,14:30: Router.replan" in table
    assert "| 11 | the next append's logits after the move bit-identical to the replayed session's | yes |" in table


def test_move_section_refuses_too_few_tokens_before_starting_a_daemon(shards, tmp_path, model_path):
    options = _options(tmp_path, model_path, move_lengths=(128,))
    (tmp_path / "sockets").mkdir(mode=0o700)
    with pytest.raises(ValueError, match="128 tokens given, 129 needed"):
        measure_move(shards, shards, list(range(128)), tmp_path / "sockets", options, say=lambda _line: None)
    assert not list((tmp_path / "sockets").iterdir())


# ---- section 12 (shared prefixes), checked on the quick bench's run --------------------------------------


def _check_prefix_section(results: dict, table: list[str]) -> None:
    """What section 12 must show in a quick run: every variant timed three times, every cached session started
    from the stored system prompt (512 tokens in the quick run, 1,024 in the full one) on all three daemons, the
    memory readings of both modes, its ratios and rows."""
    prefix = results["prefix"]
    system = QUICK_SYSTEM_TOKENS
    assert (prefix["system_tokens"], prefix["message_tokens"], prefix["block"], prefix["rounds"]) == (system, 32, 32, 3)
    for name in ("cached", "uncached", "llama.cpp", "llama.cpp fresh context", "components"):
        assert len(prefix["runs"][name]) == 3, name
    for name in ("cached", "uncached", "llama.cpp", "llama.cpp fresh context"):
        assert all(one["s"] > 0 for one in prefix["runs"][name]), name
    assert all(one["reused_tokens"] == system and one["hits"] == 1 and one["first_append_rows"] == system for one in prefix["runs"]["cached"])
    assert all(one["reused_tokens"] == 0 and one["hits"] == 0 for one in prefix["runs"]["uncached"])
    for one in prefix["runs"]["components"]:
        assert one["held_blocks"] == system // 32 and one["admitted"] and one["restored"] == [True] * 3
        assert all(one[key] > 0 for key in ("lookup_s", "admit_s")) and one["ahead_wait_s"] >= 0
        assert all(seconds > 0 for key in ("first_append_s", "hot_append_s") for seconds in one[key])
    assert all(one["restore_s"] > 0 and one["rows_s"] > 0 for one in prefix["runs"]["llama.cpp"])
    assert all(one["create_s"] > 0 for one in prefix["runs"]["llama.cpp fresh context"])
    first = prefix["first_tokens"]
    assert first["cached"] == first["uncached"] == first["llama.cpp"] == first["llama.cpp fresh context"]  # the same first token every way
    assert prefix["prefix_state_bytes"] > 0.9 * system * sum(prefix["kv_bytes_per_position"])  # the whole model's KV of those positions, about
    assert prefix["integrity"] == ["ok"] * 3 and prefix["sessions_left"] == 0

    for mode in ("process", "batched"):
        memory = prefix["memory"][mode]
        assert memory["reused_tokens"] == 4 * system and memory["hits"] == 4 and not any(memory["sessions_left"])
        assert all(session["tier"] == "hot" and session["length"] == system + 32 for reading in memory["held"] for session in reading["sessions"])
        assert [len(reading["sessions"]) for reading in memory["held"]] == [4] * 3
        assert all(reading["prefix_entries"] == 1 and reading["prefix_bytes"] > 0 for reading in memory["after_seed"])
        assert all(held["prefix_bytes"] > seed["prefix_bytes"] for held, seed in zip(memory["held"], memory["after_seed"]))
        assert all(held["reserved_bytes"] > 0 and held["workers_uss_bytes"] > 0 for held in memory["held"])

    summary, ratios = results["summary"], results["ratios"]
    assert summary["s12_reused_every_round"] and summary["s12_first_token_identical"] and summary["s12_books_ok"]
    for key, value in summary.items():
        if key.startswith("s12_") and not isinstance(value, bool):
            assert math.isfinite(value), key
            if key.endswith("_s") and "_less_" not in key:  # a difference of two timings may come out below 0 by noise
                assert value > 0, key
    assert ratios["prefix_cached_vs_uncached_ttft"]["target"] == 10 and ratios["prefix_vs_llama_cpp_ttft"]["target"] == 0.9
    assert all(ratios[key]["value"] > 0 for key in ("prefix_cached_vs_uncached_ttft", "prefix_vs_llama_cpp_ttft", "prefix_memory_process_vs_batched"))
    for expected in (f"| 12 | new session, {system:,}-token system prompt + 32-token message, 3 shard daemons, time to first token",
                     "| 12 | the same vs llama.cpp in one process reusing the prefix as its server does",
                     "| 12 | where the cached time goes", "--mode process vs --mode batched: budget reserved",
                     f"| 12 | every cached session started from {system:,} stored tokens on all 3 daemons"):
        assert any(expected in line for line in table), expected
    assert results["environment"]["cpu_model"]


# ---- options and their limits ------------------------------------------------------------------------------


def test_durable_move_and_prefix_lengths_fit_the_sections_n_ctx_at_the_edge(tmp_path, model_path):
    assert _options(tmp_path, model_path, durable_lengths=(DURABLE_N_CTX - 1,)).durable_lengths == (DURABLE_N_CTX - 1,)
    for lengths in ((DURABLE_N_CTX,), (0,), ()):
        with pytest.raises(ValueError, match="durable lengths"):
            _options(tmp_path, model_path, durable_lengths=lengths)
    assert _options(tmp_path, model_path, move_lengths=(MOVE_N_CTX - 1,)).move_lengths == (MOVE_N_CTX - 1,)
    for lengths in ((MOVE_N_CTX,), (0,), ()):
        with pytest.raises(ValueError, match="move lengths"):
            _options(tmp_path, model_path, move_lengths=lengths)
    assert _options(tmp_path, model_path, prefix_system_tokens=PREFIX_N_CTX - 64).prefix_system_tokens == PREFIX_N_CTX - 64
    for tokens in (PREFIX_N_CTX - 63, 0):
        with pytest.raises(ValueError, match="prefix system prompt"):
            _options(tmp_path, model_path, prefix_system_tokens=tokens)
    assert BenchOptions.quick_run(tmp_path, model_path).prefix_system_tokens == QUICK_SYSTEM_TOKENS
    for field in ("durable_sessions", "durable_rounds", "move_rounds", "prefix_rounds"):
        assert getattr(_options(tmp_path, model_path, **{field: 1}), field) == 1
        with pytest.raises(ValueError, match="at least 1"):
            _options(tmp_path, model_path, **{field: 0})


def _parsed(*argv: str):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def test_only_takes_known_sections_and_the_durable_move_and_prefix_flags_override_quick(tmp_path):
    args = _parsed("--only", "durable,overload,durable,move", "--quick", "--durable-sessions", "3", "--move-rounds", "2", "--out", str(tmp_path))
    assert args.only == ["durable", "overload", "move"]
    options = options_from_args(args)
    assert (options.durable_sessions, options.durable_rounds, options.durable_lengths) == (3, 1, (512, 2048))
    assert (options.move_rounds, options.move_lengths) == (2, (128, 512))
    assert _parsed("--only", "durable,").only == ["durable"]
    assert options.prefix_rounds == 3  # quick
    prefix = options_from_args(_parsed("--only", "prefix", "--quick", "--prefix-rounds", "5", "--out", str(tmp_path)))
    assert prefix.prefix_rounds == 5 and options_from_args(_parsed("--out", str(tmp_path))).prefix_rounds == 7
    assert _parsed("--only", "warm,prefix").only == ["warm", "prefix"]
    assert _parsed("--only", "decode,warm").only == ["decode", "warm"]
    for bad in ("cold", "warm,cold", ",", ""):
        with pytest.raises(argparse.ArgumentError, match="--only takes a comma-separated list of decode, warm, overload, startup, durable, move, prefix"):
            _parsed("--only", bad)
    with pytest.raises(argparse.ArgumentError, match="not allowed with argument"):
        _parsed("--only", "durable", "--overload-only")


@pytest.mark.timeout(BENCH_HANG_GUARD_S + 300)
@pytest.mark.parametrize(("threads", "keep_warm"), [(None, None), (2, 0)])
def test_only_decode_runs_sections_1_2_and_4_on_their_own_daemons(tmp_path, threads, keep_warm) -> None:
    """`--only decode`: the one-session sections alone, on the mid, chain and whole daemons only (not section 3's
    batched ones), with their rows, ratios and spreads, and nothing of the other sections; with --threads 2 every
    daemon's worker and every in-process reference at 2 llama threads, with --keep-warm 0 every daemon's spinners
    off (default: 1 s), and the rows say so."""
    out = tmp_path / "bench"
    completed = run_to_completion(
        [sys.executable, "-m", "kvpool", "bench", "--only", "decode", "--quick", "--rounds", "1", "--decode-steps", "3", "--no-chart", "--out", str(out),
         *(["--threads", str(threads)] if threads else []), *(["--keep-warm", str(keep_warm)] if keep_warm is not None else [])],
        cwd=REPOSITORY, timeout_s=BENCH_HANG_GUARD_S,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads((out / "bench-decode.json").read_text())
    assert sorted(results["daemons"]["options"]) == ["chain0", "chain1", "chain2", "mid", "whole"]
    assert {"mid_shard", "route"} <= results.keys() and not {"parallel", "admission", "memory", "warm"} & results.keys()
    sections = {line.split("|")[1].strip() for line in completed.stdout.splitlines() if line.startswith("| ") and not line.startswith("| #")}
    assert sections == {"1", "2", "4"}
    assert {"daemon_vs_inprocess", "route_vs_whole"} <= results["ratios"].keys()
    assert all(results["ratios"][name]["value"] > 0 for name in ("daemon_vs_inprocess", "route_vs_whole"))
    assert results["summary"]["s2_tokens_identical"] and set(results["load"]) == {"mid_shard", "route"}
    # section 2's variants take turns every chunk_steps (3) timed steps: 3 timed and 1 cold step each here
    assert {len(values) for values in results["route"]["decode_s"].values()} == {3} and results["route"]["chunk_steps"] == 3
    assert {len(values) for values in results["route"]["cold_decode_s"].values()} == {1}
    assert any("the first step of each turn" in line and line.startswith("| 2 ") for line in completed.stdout.splitlines())
    expected = threads or 1
    assert results["options"]["threads"] == expected and results["mid_shard"]["threads"] == results["route"]["threads"] == expected
    warm = 1.0 if keep_warm is None else float(keep_warm)
    assert results["options"]["keep_warm_s"] == results["mid_shard"]["keep_warm_s"] == results["route"]["keep_warm_s"] == warm
    for name, options in results["daemons"]["options"].items():
        per_worker = [options[index + 1] for index, flag in enumerate(options) if flag == "--threads-per-worker"]
        assert per_worker == [str(expected)], (name, options)
        assert [options[index + 1] for index, flag in enumerate(options) if flag == "--keep-warm"] == [repr(warm)], (name, options)
    said = f"{expected} llama thread{'s' if expected > 1 else ''} a context, both sides; daemons --keep-warm {warm:g}"
    assert sum(said in line for line in completed.stdout.splitlines()) == 2  # section 1's headline row and section 2's

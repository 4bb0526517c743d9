"""`kvpool bench --rigs N` (issue 29, item 4): the same run in N fresh processes, every headline ratio's verdict on
its median across them. The runs here are stand-ins (they write a results file as a run does), spawned as the
real ones are."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from kvpool.bench.cli import main as bench_main
from kvpool.bench.options import BenchOptions
from kvpool.bench.rigs import MAX_RIGS, RigFailed, check_rigs, combine, render, run_rigs

JSON_NAME = "bench-decode.json"
ROUTE = [0.941, 0.999, 0.962]  # one reading per rig


def _ratio(value: float, target: float | None = 0.97, *, at_most: bool = False, verdict: str | None = None) -> dict:
    met = None if target is None else (value <= target if at_most else value >= target)
    entry = {"value": value, "target": target, "at_most": at_most, "met": met}
    entry["verdict"] = verdict or ("no target" if met is None else "met" if met else "MISSED")
    return entry


def _results(route: float, pid: int = 0) -> dict:
    return {"environment": {"pid": pid}, "table": f"| route {route} |",
            "ratios": {"route_vs_whole": _ratio(route), "first_admission_vs_bare": _ratio(1.2, 1.5, at_most=True), "plain": _ratio(2.0, None)}}


def test_the_verdict_is_taken_on_the_median_across_the_rigs():
    combined = combine([_results(value) for value in ROUTE])
    route = combined["route_vs_whole"]
    assert route["values"] == ROUTE and route["value"] == 0.962 and (route["min"], route["max"]) == (0.941, 0.999)
    assert route["met"] is False and route["verdict"] == "MISSED"  # two rigs of three under 0.97, whatever the best one read
    assert combine([_results(value) for value in (0.941, 0.999, 0.975)])["route_vs_whole"]["verdict"] == "met"
    assert combined["first_admission_vs_bare"]["verdict"] == "met" and combined["first_admission_vs_bare"]["at_most"]
    assert combined["plain"]["verdict"] == "no target"
    table = render(combined)
    assert "| route_vs_whole | 0.941 | 0.999 | 0.962 | 0.962 (0.941-0.999) | >= 0.97 | MISSED |" in table
    assert "| first_admission_vs_bare | 1.200 | 1.200 | 1.200 | 1.200 (1.200-1.200) | <= 1.50 | met |" in table


def test_a_rig_that_withheld_a_verdict_withholds_the_combined_one(capsys):
    runs = [_results(value) for value in ROUTE]
    runs[1]["ratios"]["route_vs_whole"] = _ratio(0.999, verdict="contended: not a ratio (other processes used 0.30 cores)")
    del runs[2]["ratios"]["plain"]
    combined = combine(runs)
    route = combined["route_vs_whole"]
    assert route["met"] is None and route["verdict"] == "rig 2: contended: not a ratio (other processes used 0.30 cores)"
    assert route["value"] == 0.962  # the median is kept beside the reason
    assert "plain" not in combined  # a ratio is combined only where every rig has it, and the run says so
    assert "not in every rig, so not combined: plain" in capsys.readouterr().err


def test_rigs_are_counted_from_one_to_the_limit():
    assert check_rigs(1) == 1 and check_rigs(MAX_RIGS) == MAX_RIGS
    for count in (0, -1, MAX_RIGS + 1):
        with pytest.raises(ValueError, match="--rigs takes 1 to"):
            check_rigs(count)
    with pytest.raises(ValueError):
        combine([])


def test_the_command_line_refuses_a_count_out_of_range(capsys):
    """Refused as the arguments are read (exit 2), before any model is looked for."""
    from kvpool.cli.main import main as kvpool_main

    for argv, said in ((["bench", "--only", "decode", "--rigs", "0"], "--rigs takes 1 to 9 runs (got 0)"),
                       (["bench", "--rigs", "10", "--model", "/nonexistent.gguf"], "--rigs takes 1 to 9 runs (got 10)"),
                       (["bench", "--rigs", "two"], "--rigs takes a whole number (got 'two')")):
        with pytest.raises(SystemExit) as exited:
            kvpool_main(argv)
        assert exited.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["--only", "decode", "--rigs", "-1"])
    assert "(got -1)" in capsys.readouterr().err


SET_IN_THE_PARENT = {"set": False}  # a spawned interpreter imports this module afresh: it never sees the parent's change


def stand_in_run(options: BenchOptions) -> None:
    """What a run leaves: its results file; its route reading by rig (rig-1, rig-2, ...) and its process id."""
    index = int(options.out_dir.name.split("-")[1])
    assert not options.chart and options.json_path is None
    options.out_dir.mkdir(parents=True)
    results = _results(ROUTE[index - 1], os.getpid())
    results["environment"]["inherited"] = SET_IN_THE_PARENT["set"]
    (options.out_dir / JSON_NAME).write_text(json.dumps(results))


def failing_run(options: BenchOptions) -> None:
    if options.out_dir.name == "rig-2":
        raise SystemExit(3)
    stand_in_run(options)


def test_each_rig_runs_in_a_fresh_process_and_the_median_is_written(tmp_path, capsys):
    options = BenchOptions(out_dir=tmp_path / "out", model=pathlib.Path("unused.gguf"), chart=True, json_path=tmp_path / "copy.json")
    SET_IN_THE_PARENT["set"] = True
    try:
        results, table = run_rigs(stand_in_run, options, 3, JSON_NAME)
    finally:
        SET_IN_THE_PARENT["set"] = False
    pids = [environment["pid"] for environment in results["environments"]]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert not any(environment["inherited"] for environment in results["environments"])  # spawned, not forked
    assert results["ratios"]["route_vs_whole"]["values"] == ROUTE and results["ratios"]["route_vs_whole"]["verdict"] == "MISSED"
    written = json.loads((tmp_path / "out" / "bench-decode-rigs.json").read_text())
    assert written == json.loads((tmp_path / "copy.json").read_text()) and written["table"] == table
    assert written["runs"] == [str(tmp_path / "out" / f"rig-{index}" / JSON_NAME) for index in (1, 2, 3)]
    assert "rig 3:\n| route 0.962 |" in capsys.readouterr().out


def test_a_failed_rig_stops_the_run_and_says_which(tmp_path):
    options = BenchOptions(out_dir=tmp_path / "out", model=pathlib.Path("unused.gguf"))
    with pytest.raises(RigFailed, match=r"rig 2 of 3 failed \(exit code 3\)"):
        run_rigs(failing_run, options, 3, JSON_NAME)
    assert (tmp_path / "out" / "rig-1" / JSON_NAME).exists() and not (tmp_path / "out" / "rig-3").exists()

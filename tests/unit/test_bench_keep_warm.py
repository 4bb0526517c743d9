"""`kvpool bench --keep-warm SECONDS`: the daemons' --keep-warm in sections 1-5 (default 1 s; 0: off), refused out of
kvpool serve's range as the arguments are read (exit 2), before any model is looked for; what a run does with it:
tests/drills/test_bench.py (--only decode)."""

from __future__ import annotations

import math
import pathlib

import pytest

from kvpool.bench.options import BENCH_KEEP_WARM_S, BenchOptions
from kvpool.daemon.keep_warm import MAX_KEEP_WARM_S


@pytest.mark.parametrize(("given", "said"), [
    ("-1", "--keep-warm must be in [0, 3600] seconds (got -1)"),
    ("nan", "--keep-warm must be in [0, 3600] seconds (got nan)"),
    (str(MAX_KEEP_WARM_S + 0.5), "--keep-warm must be in [0, 3600] seconds (got 3600.5)"),
    ("one", "--keep-warm takes a number of seconds (got 'one')"),
])
def test_the_command_line_refuses_what_kvpool_serve_refuses(capsys, given, said):
    from kvpool.cli.main import main as kvpool_main

    with pytest.raises(SystemExit) as exited:
        kvpool_main(["bench", "--only", "decode", "--keep-warm", given, "--model", "/nonexistent.gguf"])
    assert exited.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("sections", [["--only", "warm"], ["--only", "overload,prefix"], ["--overload-only"]])
def test_the_command_line_refuses_it_where_no_section_1_to_5_runs(capsys, sections):
    from kvpool.cli.main import main as kvpool_main

    try:
        code = kvpool_main(["bench", *sections, "--keep-warm", "0", "--model", "/nonexistent.gguf"])
    except SystemExit as exited:
        code = exited.code
    assert code == 2 and "--keep-warm applies to sections 1-5's daemons: give it with a whole run or --only decode" in capsys.readouterr().err


def test_the_options_hold_0_to_the_limit_and_default_to_1_second(tmp_path):
    import argparse

    from kvpool.bench.cli import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    model = pathlib.Path("m.gguf")
    assert BenchOptions(out_dir=tmp_path, model=model).keep_warm_s == BENCH_KEEP_WARM_S == 1.0
    for edge in (0.0, MAX_KEEP_WARM_S):
        assert BenchOptions(out_dir=tmp_path, model=model, keep_warm_s=edge).keep_warm_s == edge
        assert options_from_args(parser.parse_args(["--model", str(model), "--keep-warm", f"{edge:g}"])).keep_warm_s == edge
    for wrong in (-0.001, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"--keep-warm must be in \[0, 3600\] seconds"):
            BenchOptions(out_dir=tmp_path, model=model, keep_warm_s=wrong)

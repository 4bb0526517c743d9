"""`kvpool bench --threads N`: sections 1, 2 and 4 alone (--only decode) at N llama threads a context on both
sides; refused elsewhere and out of range, as the arguments are read (exit 2), before any model is looked for."""

from __future__ import annotations

import pathlib

import pytest

from kvpool.bench.options import MAX_THREADS, BenchOptions


def test_the_command_line_takes_threads_with_only_decode_and_refuses_the_rest(capsys, tmp_path):
    from kvpool.cli.main import main as kvpool_main

    for argv, said in ((["bench", "--only", "decode", "--threads", "0"], f"--threads takes 1 to {MAX_THREADS} (got 0)"),
                       (["bench", "--only", "decode", "--threads", str(MAX_THREADS + 1)], f"--threads takes 1 to {MAX_THREADS} (got {MAX_THREADS + 1})"),
                       (["bench", "--only", "decode", "--threads", "two"], "--threads takes a whole number (got 'two')"),
                       (["bench", "--threads", "2", "--model", "/nonexistent.gguf"], "--threads applies to sections 1, 2, 4 alone: give it with --only decode"),
                       (["bench", "--only", "decode,warm", "--threads", "2", "--model", "/nonexistent.gguf"], "give it with --only decode"),
                       (["bench", "--overload-only", "--threads", "1", "--model", "/nonexistent.gguf"], "give it with --only decode")):
        try:
            code = kvpool_main(argv)
        except SystemExit as exited:
            code = exited.code
        assert code == 2 and said in capsys.readouterr().err, argv


def test_the_options_hold_1_to_the_limit(tmp_path):
    model = pathlib.Path("m.gguf")
    assert BenchOptions(out_dir=tmp_path, model=model).threads == 1  # kvpool's default --threads-per-worker
    for edge in (1, MAX_THREADS):
        assert BenchOptions(out_dir=tmp_path, model=model, threads=edge).threads == edge
    for wrong in (0, MAX_THREADS + 1):
        with pytest.raises(ValueError, match=rf"--threads takes 1 to {MAX_THREADS} \(got {wrong}\)"):
            BenchOptions(out_dir=tmp_path, model=model, threads=wrong)

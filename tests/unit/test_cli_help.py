"""Every `kvpool` command builds its parser and explains itself (`--help` exits 0 and names each flag), in
process and without a model: a broken import or a flag defined twice fails here in milliseconds."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from kvpool.cli.main import build_parser, main
from kvpool.daemon.config import flags

COMMANDS = ["demo", "shard", "generate", "serve", "status", "stress", "bench"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, "--help"])
    assert exited.value.code == 0 and f"usage: kvpool {command}" in out.getvalue()


def test_serve_help_names_every_setting_once():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = out.getvalue()
    for _field, option in flags():
        assert f"  {option.name}" in text, option.name
    assert len({option.name for _field, option in flags()}) == len(flags())


def test_a_command_imports_only_its_own_module():
    """`kvpool serve` (every daemon start) builds its own parser alone: its supervisor loads neither the bench,
    the stress harness nor the worker's llama.cpp runtime (workers.server.entry spawns workers.server.main)."""
    probe = ("import sys; from kvpool.cli.main import build_parser; build_parser('serve'); "
             "print(' '.join(sorted(m for m in sys.modules if m.startswith(('kvpool.bench', 'kvpool.stress', 'kvpool.cli.', 'workers.')))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert "kvpool.cli.serve" in loaded and "workers.server.entry" in loaded
    assert not [name for name in loaded if name.startswith(("kvpool.bench", "kvpool.stress", "workers.runtime", "workers.server.main"))], loaded
    assert not {"kvpool.cli.bench", "kvpool.cli.demo", "kvpool.cli.stress"} & set(loaded)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main(["--help"])  # no command named: every command's parser, as before
    assert exited.value.code == 0 and all(command in out.getvalue() for command in COMMANDS)

"""Every `kvpool` command builds its parser and explains itself (`--help` exits 0 and names each flag), in
process and without a model: a broken import or a flag defined twice fails here in milliseconds."""

from __future__ import annotations

import contextlib
import io

import pytest

from kvpool.cli.main import build_parser
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

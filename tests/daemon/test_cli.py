"""The user-facing commands, run as a user runs them: `python -m kvpool ...` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.local.chain import LocalChain
from kvpool.local.generate import greedy_tokens
from tests.conftest import EVEN_SPLIT
from tests.support.daemons import run_to_completion

PROMPT = "Name three colors."
# Hang guards only: the slowest command here (demo: cut 3 shards, start 3 daemons, 16 tokens) takes
# seconds on 2 quiet cores. A slow machine must never fail a test by itself.
COMMAND_HANG_GUARD_S = 1500
pytestmark = pytest.mark.timeout(COMMAND_HANG_GUARD_S + 300)


def _kvpool(*args: str, work_dir) -> subprocess.CompletedProcess:
    environment = os.environ | {"KVPOOL_WORK_DIR": str(work_dir)}
    return run_to_completion([sys.executable, "-m", "kvpool", *args], timeout_s=COMMAND_HANG_GUARD_S, env=environment)


@pytest.fixture(scope="module")
def expected_ids(shard_sets, tokenizer):
    prompt = tokenizer.encode(tokenizer.chat_prompt(PROMPT))
    with LocalChain([shard.path for shard in shard_sets[EVEN_SPLIT]]) as chain, chain.new_session(256) as session:
        return list(greedy_tokens(session.append, prompt, 16, is_end=tokenizer.is_end_of_generation))


def _printed_ids(stdout: str, count: int) -> list[int]:
    return [int(line) for line in stdout.strip().splitlines()[-count:]]


def test_generate_prints_text_and_ids_of_the_three_shard_chain(expected_ids, tokenizer, tmp_path):
    result = _kvpool("generate", PROMPT, "--max-tokens", "16", "--ids", work_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _printed_ids(result.stdout, len(expected_ids)) == expected_ids
    text = tokenizer.decode([t for t in expected_ids if not tokenizer.is_end_of_generation(t)])
    assert result.stdout.startswith(text)
    assert "through 3 shards" in result.stderr
    assert len(list((tmp_path / "shards").rglob("*.gguf"))) == 3  # cut once, under the work directory


def test_demo_generates_through_three_daemons_and_stops_them(expected_ids, tmp_path):
    result = _kvpool("demo", PROMPT, "--max-tokens", "16", "--ids", work_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _printed_ids(result.stdout, len(expected_ids)) == expected_ids
    assert result.stderr.count("books: ok") == 3
    assert "daemons stopped (exit codes [0, 0, 0])" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("generate", "--parts", "0"), "error"),
        (("generate", "--shards", "/nonexistent"), "shard directory not found"),
        (("serve", "--model", "/nonexistent.gguf", "--socket", "/tmp/kvpool-nonexistent/x.sock"), "model file not found"),
        (("serve", "--budget", "lots"), "not a byte size"),
        (("status", "--socket", "/tmp/kvpool-nonexistent/x.sock"), "cannot connect"),
    ],
)
def test_bad_arguments_get_one_line_errors(args, message, tmp_path):
    result = _kvpool(*args, work_dir=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr

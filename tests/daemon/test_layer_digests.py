"""Per-layer weight digests (kvpool.shard.digests): a shard's digests of its blocks equal its source's of the same
layers and are recorded when it is cut; one flipped byte changes exactly its layer's digest; a daemon refuses to
start on a file whose weights are not those it records; and a re-plan refuses to move a session's K/V into a
daemon whose layer holds other weights than the one that computed it, replaying that session there instead
(issue 26, item 2). Waits are hang guards only."""

from __future__ import annotations

import pathlib
import shutil

import gguf
import numpy as np
import pytest

from kvpool.router.router import RecoveryPolicy, Router
from kvpool.shard import contents as shard_contents
from kvpool.shard import digests as shard_digests
from kvpool.shard.cache import cached_shards
from kvpool.shard.digests import WeightsMismatch, block_digests, verified_block_digests, verified_digests
from kvpool.shard.errors import ShardError
from kvpool.shard.header import file_sha256, read_shard_info
from kvpool.shard.ranges import LayerRange, parse_splits
from tests.conftest import EVEN_SPLIT, TOTAL_LAYERS, UNEVEN_SPLIT
from tests.support.chains import SteppedGreedy, daemon_chain
from tests.support.daemons import refused_start

pytestmark = pytest.mark.timeout(3600)
N_CTX = 256
CHUNK = 7  # the prompt's appends
QUICK = RecoveryPolicy(backoff_base_s=0.01, backoff_max_s=0.1)
OPTIONS = ("--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "2")
NEW_SPLIT = "0:14,14:30"


def flip_first_byte(path: pathlib.Path, tensor_name: str) -> gguf.GGMLQuantizationType:
    """Flip every bit of the first data byte of `tensor_name` in place; its ggml type."""
    tensor = next(tensor for tensor in gguf.GGUFReader(path).tensors if tensor.name == tensor_name)
    with open(path, "r+b") as stream:
        stream.seek(tensor.data_offset)
        byte = stream.read(1)[0]
        stream.seek(tensor.data_offset)
        stream.write(bytes([byte ^ 0xFF]))
    return tensor.tensor_type


def tampered_copy(shard: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """A copy of `shard` with one byte of blk.0.attn_k.weight's data flipped."""
    directory.mkdir(exist_ok=True)
    copy = directory / shard.name
    shutil.copyfile(shard, copy)
    # Q4_1: the first byte is the low byte of the first block's fp16 scale, so the weights stay finite
    assert flip_first_byte(copy, "blk.0.attn_k.weight") == gguf.GGMLQuantizationType.Q4_1
    return copy


def recorded_as_found(path: pathlib.Path, recorded: str, found: str) -> None:
    """Replace the digest `recorded` in the file's bytes by `found` (same length, in place): the file then
    records the digest of the weights it holds, and loads."""
    data = path.read_bytes()
    path.write_bytes(data.replace(recorded.encode(), found.encode()))


# ---- the digests themselves (no daemon) ---------------------------------------------------------------------


@pytest.mark.parametrize("split", [EVEN_SPLIT, UNEVEN_SPLIT])
def test_a_shards_block_digests_equal_its_sources_digests_of_the_same_layers_and_are_recorded(shard_sets, model_path, split):
    source = block_digests(model_path)
    assert len(source) == TOTAL_LAYERS and len(set(source)) == TOTAL_LAYERS
    assert read_shard_info(model_path).layer_sha256 is None  # a whole model records none: its computed ones stand
    assert verified_block_digests(read_shard_info(model_path)) == source
    for info in shard_sets[split]:
        stored = slice(info.shape.layer_start, info.shape.layer_stop + info.lookahead_layers)
        assert block_digests(info.path) == source[stored]
        assert read_shard_info(info.path).layer_sha256 == info.layer_sha256 == source[stored]
        assert verified_block_digests(info) == source[stored]


def test_one_flipped_byte_changes_exactly_its_layers_digest_and_the_file_is_refused(shards, tmp_path):
    middle = shards[1]
    copy = tmp_path / middle.path.name
    shutil.copyfile(middle.path, copy)
    before = block_digests(copy)
    # the daemon's start-up pair, hashed side by side: the blocks' digests and the whole file's
    assert verified_digests(read_shard_info(copy)) == (before, file_sha256(middle.path))
    flip_first_byte(copy, "blk.3.attn_k.weight")
    after = block_digests(copy)
    assert [block for block in range(len(before)) if before[block] != after[block]] == [3]
    for verified in (verified_block_digests, verified_digests):
        with pytest.raises(WeightsMismatch, match=r"layer 13 \(blk\.3 of this file\) does not hold the weights recorded for it"):
            verified(read_shard_info(copy))
    shutil.copyfile(middle.path, copy)
    flip_first_byte(copy, "output_norm.weight")  # no block's tensor: no block's digest
    assert block_digests(copy) == before


def test_verified_digests_reports_a_file_it_cannot_hash_and_the_blocks_error_first(shards, tmp_path, monkeypatch):
    middle = shards[1]
    copy = tmp_path / middle.path.name
    shutil.copyfile(middle.path, copy)

    def unreadable(path):
        raise ShardError(f"cannot read {path}: Input/output error")

    monkeypatch.setattr(shard_digests, "file_sha256", unreadable)  # as the side-by-side thread calls it
    with pytest.raises(ShardError, match="cannot read"):
        verified_digests(read_shard_info(copy))
    flip_first_byte(copy, "blk.3.attn_k.weight")
    with pytest.raises(WeightsMismatch):  # both fail: the blocks' error is the one raised
        verified_digests(read_shard_info(copy))


def test_the_shard_cache_cuts_again_a_shard_written_without_layer_digests(model_path, tmp_path, monkeypatch):
    ranges = [LayerRange(0, 15), LayerRange(15, 30)]
    with monkeypatch.context() as patch:
        patch.setattr(shard_contents, "KEY_LAYER_SHA256", "kvpool.test.unrecorded")  # as an older kvpool wrote it
        old = cached_shards(model_path, ranges, root=tmp_path)
    assert [read_shard_info(info.path).layer_sha256 for info in old] == [None, None]
    new = cached_shards(model_path, ranges, root=tmp_path)
    assert [info.path for info in new] == [info.path for info in old]
    source = block_digests(model_path)
    assert [read_shard_info(info.path).layer_sha256 for info in new] == [source[0:16], source[15:30]]


# ---- a daemon on an altered file ------------------------------------------------------------------------------


def test_kvpool_serve_refuses_a_shard_whose_weights_differ_from_what_it_records_with_one_line(shards, socket_dir, tmp_path):
    tampered = tampered_copy(shards[1].path, tmp_path / "tampered")
    log = refused_start(tampered, socket_dir / "tampered.sock", *OPTIONS)
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, log
    assert errors[0].startswith(f"kvpool serve: error: {tampered}: layer 10 (blk.0 of this file) does not hold the weights"), log
    assert "Traceback" not in log and "starting" not in log, log  # refused before any worker started


# ---- a re-plan onto a route whose weights differ ------------------------------------------------------------


@pytest.fixture(scope="module")
def digest_routes(model_path, shard_root, socket_dir, tmp_path_factory):
    """The whole model in one daemon (the old route) and the new route 0:14, 14:30 whose second shard has one
    byte of blk.0.attn_k.weight (source layer 14) flipped and, so that it loads, that block's recorded digest
    rewritten to the digest of what it holds: same source, other weights."""
    first, second = cached_shards(model_path, parse_splits(NEW_SPLIT, TOTAL_LAYERS), root=shard_root / NEW_SPLIT.replace(",", "_"))
    tampered = tampered_copy(second.path, tmp_path_factory.mktemp("tampered"))
    recorded_as_found(tampered, block_digests(model_path)[second.shape.layer_start], block_digests(tampered)[0])
    with daemon_chain([model_path], socket_dir, "whole", *OPTIONS) as old, daemon_chain([first.path, tampered], socket_dir, "new", *OPTIONS) as new:
        yield old[0], new


def _rows(append, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """The last row of each append of `prompt` in CHUNKs, then of `tokens` one at a time (SteppedGreedy's partition)."""
    parts = [prompt[start : start + CHUNK] for start in range(0, len(prompt), CHUNK)] + [[token] for token in tokens]
    rows, length = [], 0
    for part in parts:
        rows.append(append(length, part)[-1].copy())
        length += len(part)
    return rows


def test_a_replan_onto_a_layer_with_other_weights_is_refused_at_the_weights_step_and_the_session_replays(digest_routes, prompt_ids):
    """The session's K/V of layer 14 was computed with the source's weights; the new route's layer 14 holds
    others. The move fails at its weights check naming layer 14, before a byte is imported; the session
    replays on the new route alone, and every logit after the re-plan equals a run on that route from 0 with
    the same appends (without the check the moved K/V mixes two sets of weights and the logits differ)."""
    whole, new = digest_routes
    old_clients, new_clients = [whole.client()], [daemon.client() for daemon in new]
    try:
        router = Router(old_clients, policy=QUICK)
        session = router.session("wa", n_ctx=N_CTX)
        run = SteppedGreedy(session.append_at, prompt_ids[0], CHUNK)
        run.step()
        replanned = router.replan(new_clients)
        run.step()
        run.step()
        reference = Router(new_clients, policy=QUICK).session("wr", n_ctx=N_CTX)
        expected = _rows(reference.append_at, prompt_ids[0], run.tokens)
        whole_model = _rows(Router(old_clients, policy=QUICK).session("ww", n_ctx=N_CTX).append_at, prompt_ids[0], run.tokens)
        assert np.abs(expected[-1] - whole_model[-1]).max() > 0.0, "the flipped byte changes the new route's logits"
        delta = float(np.abs(np.stack(run.rows[-2:]) - np.stack(expected[-2:])).max())
        assert delta == 0.0, f"after the re-plan the session's logits are {delta} from a run on the new route: {replanned}"
        failure = replanned.failed["wa"]
        assert failure.step == "weights" and "layer 14:" in str(failure), failure
        assert not replanned.moved and not replanned.replays
        counts = router.counts
        assert (counts.moves, counts.move_failures, counts.replays, counts.moved_bytes) == (0, 1, 1, 0)
        assert session.counts.replayed_tokens == len(prompt_ids[0]) + 1  # everything it held when the move failed
    finally:
        for client in [*old_clients, *new_clients]:
            for row in client.stats().sessions:
                client.release(row.session_id, row.epoch)
            client.close()

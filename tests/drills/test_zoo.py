"""The zoo (kvpool.tools.synthetic): random-weight llama GGUFs of other shapes and types, made at test time.

On each shape x type, shards cut with an uneven split give the whole model's greedy ids and logits exactly
(max |Δ| = 0), with flash attention as kvpool sets it (off, explicitly); on two of them a chain of real
daemons does too, with a truncate and a park/restore in the history. The KV size per position is
checked against llama.cpp's own KV buffer, and a first shard leaves a separate output head to the last.
"""

from __future__ import annotations

import ctypes
import re

import gguf
import llama_cpp
import numpy as np
import pytest

from kvpool.local.chain import LocalChain
from kvpool.local.tokenizer import Tokenizer
from kvpool.router.router import Router
from kvpool.shard.errors import ShardError
from kvpool.shard.ranges import parse_splits
from kvpool.shard.writer import write_shards
from kvpool.tools.synthetic import SPM_BOS_ID, ZOO, ZOO_TYPES, ZooSpec, zoo_model
from tests.support.chains import daemon_chain, greedy_with_logits
from workers.runtime.model import ShardModel
from workers.runtime.shard import AttentionShape, row_bytes

pytestmark = pytest.mark.timeout(3600)
N_CTX = 64
GREEDY = 16
PROMPT = "What is the capital of France?"
SPLITS = {"gqa": "0:1,1:4,4:6", "mha": "0:1,1:3,3:4", "mqa": "0:2,2:3,3:5", "head128": "0:1,1:3,3:4"}  # uneven
SPECS = {spec.name: spec for spec in ZOO}
ZOO_MODELS = [pytest.param(spec, file_type, id=f"{spec.name}-{file_type}") for spec in ZOO for file_type in ZOO_TYPES]


def _prompt(model_path) -> list[int]:
    with Tokenizer(model_path) as tokenizer:
        return tokenizer.encode(PROMPT)


def _whole_model_greedy(model_path, prompt, *, flash_attn=False):
    with ShardModel(model_path, flash_attn=flash_attn) as whole, whole.new_context(N_CTX) as context:
        return greedy_with_logits(lambda start, tokens: context.append(start, tokens=np.asarray(tokens, dtype=np.int32)), prompt, GREEDY)


def _shards(spec: ZooSpec, model_path, directory):
    return write_shards(model_path, parse_splits(SPLITS[spec.name], spec.n_layer), directory)


# ---- shards against the whole model, in process ------------------------------------------------------------


@pytest.mark.parametrize(("spec", "file_type"), ZOO_MODELS)
def test_shards_of_every_zoo_model_reproduce_the_whole_model_exactly(spec, file_type, tmp_path):
    model_path = zoo_model(spec, file_type)
    prompt = _prompt(model_path)
    expected_tokens, expected_logits = _whole_model_greedy(model_path, prompt)
    assert len(set(expected_tokens)) > 1, f"greedy decoding collapsed onto one token: {expected_tokens}"
    shards = _shards(spec, model_path, tmp_path)
    assert [shard.layers for shard in shards] == parse_splits(SPLITS[spec.name], spec.n_layer)
    with LocalChain([shard.path for shard in shards]) as chain, chain.new_session(N_CTX) as session:
        tokens, logits = greedy_with_logits(session.append, prompt, GREEDY)
    assert len(tokens) == GREEDY
    assert tokens == expected_tokens
    assert np.abs(logits - expected_logits).max() == 0.0


@pytest.mark.parametrize("file_type", ZOO_TYPES)
def test_with_flash_attention_on_in_every_context_the_shards_stay_exact(file_type, tmp_path):
    """`--flash-attn` set on every daemon of a route: the chain matches the whole model run with it on too."""
    spec = SPECS["head128"]
    model_path = zoo_model(spec, file_type)
    prompt = _prompt(model_path)
    expected_tokens, expected_logits = _whole_model_greedy(model_path, prompt, flash_attn=True)
    shards = _shards(spec, model_path, tmp_path)
    with LocalChain([shard.path for shard in shards], flash_attn=True) as chain, chain.new_session(N_CTX) as session:
        tokens, logits = greedy_with_logits(session.append, prompt, GREEDY)
    assert tokens == expected_tokens
    assert np.abs(logits - expected_logits).max() == 0.0


def test_bad_zoo_parameters_are_refused_with_a_shard_error():
    with pytest.raises(ShardError, match="unknown file type 'Q2_X'"):
        zoo_model(SPECS["gqa"], "Q2_X")
    with pytest.raises(ShardError, match="3 per-layer KV head counts for 4 layers"):
        ZooSpec("bad", n_head_kv=(2, 2, 2))
    with pytest.raises(ShardError, match="4 query heads do not split into groups of 3"):
        ZooSpec("bad", n_head_kv=3)
    with pytest.raises(ShardError, match="head counts must be at least 1"):
        ZooSpec("bad", n_head_kv=0)
    with pytest.raises(ShardError, match="unknown vocabulary 'bpe'"):
        ZooSpec("bad", vocab="bpe")


def test_weights_of_normal_times_0_02_collapse_greedy_decoding_onto_one_token():
    """Why the zoo scales weights by gain / sqrt(fan_in): at std 0.02 (gain 0.32 at fan_in 256) a tied-head
    model repeats one token, and the distinct-token check above would fail on it."""
    model_path = zoo_model(ZooSpec("collapsed", gain=0.32))
    tokens, _ = _whole_model_greedy(model_path, _prompt(model_path))
    assert len(set(tokens)) == 1


def test_the_sentencepiece_vocabulary_adds_bos_and_tokenizes_words_as_pieces():
    model_path = zoo_model(SPECS["head128"])
    with Tokenizer(model_path) as tokenizer:
        ids = tokenizer.encode(PROMPT)
        assert ids[0] == SPM_BOS_ID and SPM_BOS_ID not in ids[1:]
        assert tokenizer.decode(ids[1:]).strip() == PROMPT
        assert len(ids) < len(PROMPT)  # whole words are pieces, not bytes


# ---- a first shard without the output head -------------------------------------------------------------------


def test_a_first_shard_leaves_a_separate_output_head_to_the_last_and_the_chain_stays_exact(tmp_path):
    spec = SPECS["head128"]
    model_path = zoo_model(spec, "Q8_0")
    source = {tensor.name: tensor for tensor in gguf.GGUFReader(model_path).tensors}
    assert "output.weight" in source
    shards = _shards(spec, model_path, tmp_path)
    first, *_, last = (gguf.GGUFReader(shard.path) for shard in shards)
    first_names = {tensor.name for tensor in first.tensors}
    assert "output.weight" not in first_names and "output_norm.weight" in first_names
    last_head = next(tensor for tensor in last.tensors if tensor.name == "output.weight")
    assert last_head.data.tobytes() == source["output.weight"].data.tobytes()
    prompt = _prompt(model_path)
    expected = _whole_model_greedy(model_path, prompt)
    with LocalChain([shard.path for shard in shards]) as chain, chain.new_session(N_CTX) as session:
        tokens, logits = greedy_with_logits(session.append, prompt, GREEDY)
    assert tokens == expected[0]
    assert np.abs(logits - expected[1]).max() == 0.0


# ---- the KV size per position ----------------------------------------------------------------------------------

_KV_SIZE_LINE = re.compile(
    r"size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*K \(f16\): +([\d.]+) MiB, V \(f16\): +([\d.]+) MiB"
)


def _logged_kv_cache(model: ShardModel, n_ctx: int) -> tuple[str, int, int, str, str]:
    """llama.cpp's own account of a new context's KV cache, from the line it logs at creation:
    (total MiB, cells, layers, K MiB, V MiB), the MiB as printed (two decimals)."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        model.new_context(n_ctx).close()
    finally:
        model.native.set_log_verbose(False)
    found = [match for line in lines if (match := _KV_SIZE_LINE.search(line))]
    assert len(found) == 1, "".join(lines)
    total, cells, layers, k, v = found[0].groups()
    return total, int(cells), int(layers), k, v


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f}"


def test_the_kv_size_per_position_equals_llama_cpps_kv_buffer_on_a_head_dim_128_model(tmp_path):
    """head_dim 128 with n_embd 256 and 4 heads (n_embd / n_head would say 64), KV heads stored as a per-layer
    array. llama.cpp pads a context to a multiple of 256 cells, so n_ctx is one here: the buffer is exactly
    n_ctx x the estimate. It prints MiB with two decimals; at 1-3 MiB that pins the estimate to within 41 bytes
    per position (of 4096), less than one row of one head (256 bytes)."""
    spec = SPECS["head128"]
    model_path = zoo_model(spec)
    first_shard = _shards(spec, model_path, tmp_path)[0]
    for path, layers in ((model_path, spec.n_layer), (first_shard.path, 2)):  # the first shard: 1 layer + 1 lookahead
        with ShardModel(path) as model:
            estimate = model.kv_bytes_per_position()
            for n_ctx in (256, 512, 768):
                total, cells, logged_layers, k, v = _logged_kv_cache(model, n_ctx)
                assert (cells, logged_layers) == (n_ctx, layers)
                assert total == _mib(n_ctx * estimate)
                assert k == v == _mib(n_ctx * estimate // 2)
            assert estimate == layers * 2 * (2 * 128) * 2  # K and V, 2 KV heads of 128, f16


def test_kv_rows_of_quantized_cache_types_are_counted_in_blocks():
    f16, q8_0 = int(gguf.GGMLQuantizationType.F16), int(gguf.GGMLQuantizationType.Q8_0)
    assert row_bytes(f16, 256) == 512
    assert row_bytes(q8_0, 256) == 8 * 34  # blocks of 32 values, 34 bytes each
    assert AttentionShape(128, 64, (2, 1)).bytes_per_position(q8_0, f16) == (8 * 34 + 256) + (4 * 34 + 128)
    with pytest.raises(ValueError, match="does not fill Q8_0 blocks of 32"):
        row_bytes(q8_0, 48)


# ---- a chain of daemons against the whole model ------------------------------------------------------------------


@pytest.mark.parametrize(("name", "file_type"), [("mqa", "Q4_K_M"), ("head128", "Q6_K")])
def test_a_chain_of_daemons_with_a_truncate_and_a_park_reproduces_the_whole_model(name, file_type, tmp_path, socket_dir):
    spec = SPECS[name]
    model_path = zoo_model(spec, file_type)
    prompt = _prompt(model_path)
    shards = _shards(spec, model_path, tmp_path)
    options = ("--threads", "1", "--n-ctx", str(N_CTX), "--max-sessions", "1")
    with daemon_chain([shard.path for shard in shards], socket_dir, f"{name}-", *options) as daemons:
        clients = [daemon.client() for daemon in daemons]
        try:
            got = _history(Router(clients).session("zoo", n_ctx=N_CTX), clients, prompt)
            assert all(client.stats().counters["restores"] == 1 for client in clients)
        finally:
            for client in clients:
                client.close()
    with ShardModel(model_path) as whole, whole.new_context(N_CTX) as context:
        expected = _history(_WholeModelSession(context), None, prompt)
    assert len(set(expected[0])) > 1
    assert got[0] == expected[0]
    assert np.abs(got[1] - expected[1]).max() == 0.0


class _WholeModelSession:
    """The whole model behind the routed session's calls the history makes."""

    def __init__(self, context) -> None:
        self.context = context
        self.epoch = 1

    def append(self, tokens):
        return self.context.append(self.context.length, tokens=np.asarray(tokens, dtype=np.int32))

    def truncate(self, length: int) -> None:
        self.context.truncate(length)


def _history(session, clients, prompt):
    """Prefill, 4 greedy steps, truncate 2 of them away, park the session on every daemon (when there are
    daemons), then 8 greedy steps: the tokens chosen and the logits each came from."""
    tokens, rows = [], []

    def step(ids):
        logits = session.append(ids)
        rows.append(logits[-1].copy())
        tokens.append(int(np.argmax(rows[-1])))

    step(prompt)
    for _ in range(4):
        step([tokens[-1]])
    session.truncate(len(prompt) + 2)
    for client in clients or ():
        assert client.park("zoo", session.epoch).detail == "parked"
    step([tokens[0]])  # another branch than the one truncated away
    for _ in range(7):
        step([tokens[-1]])
    return tokens, np.stack(rows)

"""Shard files of the real bundled model: metadata, byte-exact tensors, llama.cpp loading, CLI errors."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import os
import pathlib

import gguf
import llama_cpp
import numpy as np
import pytest

from kvpool.cli import shard as cli_shard
from kvpool.shard import contents as shard_contents
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import cached_shards
from kvpool.shard.digests import block_digests
from kvpool.shard.errors import ShardError
from kvpool.shard.header import (
    KEY_FORMAT,
    KEY_LAYER_SHA256,
    KEY_LAYER_START,
    KEY_LAYER_STOP,
    KEY_LOOKAHEAD_LAYERS,
    KEY_SOURCE_SHA256,
    KEY_TOTAL_LAYERS,
    ShardInfo,
    file_sha256,
    read_shard_info,
)
from kvpool.shard.ranges import LayerRange
from kvpool.shard.writer import write_shard, write_shards
from kvpool.wire.shape import ShardShape
from workers.runtime.model import ShardModel

TOTAL_LAYERS = 30
N_EMBD = 576
N_VOCAB = 49152
SPLITS = [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]
KINDS = ["first", "middle", "last"]
KVPOOL_KEYS = {KEY_FORMAT, KEY_LAYER_START, KEY_LAYER_STOP, KEY_TOTAL_LAYERS, KEY_SOURCE_SHA256, KEY_LAYER_SHA256}
GGUF_COUNT_KEYS = {"GGUF.tensor_count", "GGUF.kv_count"}
LOOKAHEAD = {"first": 1, "middle": 0, "last": 0}  # the first shard also stores the next layer, never run


def kvpool_keys(kind: str) -> set[str]:
    return KVPOOL_KEYS | ({KEY_LOOKAHEAD_LAYERS} if LOOKAHEAD[kind] else set())


@dataclasses.dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(*argv: str | os.PathLike[str]) -> CliResult:
    """Run `kvpool shard ...` in-process, built the way kvpool/cli/main.py builds its parser."""
    parser = argparse.ArgumentParser(prog="kvpool")
    subparsers = parser.add_subparsers(dest="command", required=True)
    cli_shard.add_parser(subparsers)
    args = parser.parse_args(["shard", *map(str, argv)])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = args.func(args)
    return CliResult(code, stdout.getvalue(), stderr.getvalue())


def tree(root: pathlib.Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


@pytest.fixture(scope="session")
def source() -> pathlib.Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def source_sha256(source: pathlib.Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def source_layer_sha256(source: pathlib.Path) -> tuple[str, ...]:
    return block_digests(source)


@pytest.fixture(scope="session")
def source_reader(source: pathlib.Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(source)


@pytest.fixture(scope="session")
def cli_parts(tmp_path_factory: pytest.TempPathFactory, source: pathlib.Path) -> tuple[pathlib.Path, CliResult]:
    """`kvpool shard --parts 3`, once per session: the shards [0,10) [10,20) [20,30) every test reads."""
    out_dir = tmp_path_factory.mktemp("shards") / "out"
    return out_dir, run_cli("--parts", "3", "-o", out_dir)


@pytest.fixture(scope="session")
def shard_paths(cli_parts: tuple[pathlib.Path, CliResult], source: pathlib.Path) -> dict[str, pathlib.Path]:
    out_dir, result = cli_parts
    assert result.code == 0, result.stderr
    names = [f"{source.stem}.layers-{r.start:02d}-{r.stop:02d}.gguf" for r in SPLITS]
    return {kind: out_dir / name for kind, name in zip(KINDS, names)}


@pytest.fixture(scope="session")
def shard_readers(shard_paths: dict[str, pathlib.Path]) -> dict[str, gguf.GGUFReader]:
    return {kind: gguf.GGUFReader(path) for kind, path in shard_paths.items()}


def field_value(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def field_types(reader: gguf.GGUFReader, key: str) -> list[gguf.GGUFValueType]:
    field = reader.get_field(key)
    assert field is not None, key
    return list(field.types)


def tensors_by_name(reader: gguf.GGUFReader) -> dict[str, object]:
    return {tensor.name: tensor for tensor in reader.tensors}


# --- the shards of the bundled model ------------------------------------------------------------------------


def test_cli_parts_reports_every_shard(
    cli_parts: tuple[pathlib.Path, CliResult], shard_paths: dict[str, pathlib.Path]
) -> None:
    out_dir, result = cli_parts
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    for line, layers, path in zip(lines, SPLITS, shard_paths.values()):
        reported_path, reported_range, reported_size, reported_sha = line.split("\t")
        assert pathlib.Path(reported_path) == path
        assert reported_range == str(layers)
        assert int(reported_size) == path.stat().st_size
        assert reported_sha == file_sha256(path)
    assert tree(out_dir) == {path.name for path in shard_paths.values()}  # no partial files left
    assert "hashing source" in result.stderr
    assert f"writing {shard_paths['first'].name} (1/3)" in result.stderr


@pytest.mark.parametrize(("kind", "layers"), list(zip(KINDS, SPLITS)))
def test_shard_metadata_round_trip(
    kind: str,
    layers: LayerRange,
    shard_paths: dict[str, pathlib.Path],
    shard_readers: dict[str, gguf.GGUFReader],
    source: pathlib.Path,
    source_sha256: str,
    source_layer_sha256: tuple[str, ...],
) -> None:
    path = shard_paths[kind]
    assert file_sha256(source) == source_sha256
    info = read_shard_info(path)
    stored = source_layer_sha256[layers.start : layers.stop + LOOKAHEAD[kind]]
    assert info == ShardInfo(
        path=path,
        arch="llama",
        shape=ShardShape(
            layer_start=layers.start,
            layer_stop=layers.stop,
            total_layers=TOTAL_LAYERS,
            n_embd=N_EMBD,
            n_vocab=32 if kind == "middle" else N_VOCAB,
        ),
        source_sha256=source_sha256,
        vocab_free=kind == "middle",
        lookahead_layers=LOOKAHEAD[kind],
        layer_sha256=stored,
    )
    assert (info.shape.is_first, info.shape.is_last, info.shape.n_layers) == (kind == "first", kind == "last", 10)
    reader = shard_readers[kind]
    assert field_value(reader, "general.architecture") == "llama"
    assert field_value(reader, "llama.block_count") == 10 + LOOKAHEAD[kind]
    assert field_types(reader, "llama.block_count") == [gguf.GGUFValueType.UINT32]
    expected = [(KEY_FORMAT, 1 + LOOKAHEAD[kind]), (KEY_LAYER_START, layers.start), (KEY_LAYER_STOP, layers.stop), (KEY_TOTAL_LAYERS, 30)]
    if LOOKAHEAD[kind]:
        expected.append((KEY_LOOKAHEAD_LAYERS, LOOKAHEAD[kind]))
    else:
        assert KEY_LOOKAHEAD_LAYERS not in reader.fields
    for key, value in expected:
        assert field_value(reader, key) == value
        assert field_types(reader, key) == [gguf.GGUFValueType.UINT32]
    assert field_types(reader, KEY_SOURCE_SHA256) == [gguf.GGUFValueType.STRING]
    assert field_types(reader, KEY_LAYER_SHA256) == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    assert tuple(reader.fields[KEY_LAYER_SHA256].contents()) == stored


def test_whole_model_info(source: pathlib.Path) -> None:
    info = read_shard_info(source)
    assert info == ShardInfo(
        source, "llama", ShardShape(layer_start=0, layer_stop=30, total_layers=30, n_embd=N_EMBD, n_vocab=N_VOCAB), None, False
    )
    assert info.shape.is_first and info.shape.is_last and str(info.layers) == "0:30"


@pytest.mark.parametrize("kind", ["first", "last"])
def test_full_vocabulary_shards_copy_every_metadata_key_with_its_type(
    kind: str, shard_readers: dict[str, gguf.GGUFReader], source_reader: gguf.GGUFReader
) -> None:
    shard = shard_readers[kind]
    assert set(shard.fields) == set(source_reader.fields) | kvpool_keys(kind)
    for key, field in source_reader.fields.items():
        if key in GGUF_COUNT_KEYS or key == "llama.block_count":
            continue
        copied = shard.fields[key]
        assert copied.types == field.types, key
        assert copied.contents() == field.contents(), key
    assert field_value(shard, "GGUF.kv_count") == field_value(source_reader, "GGUF.kv_count") + len(kvpool_keys(kind))


@pytest.mark.parametrize(("kind", "layers"), list(zip(KINDS, SPLITS)))
def test_block_tensors_are_renumbered_byte_for_byte(
    kind: str, layers: LayerRange, shard_readers: dict[str, gguf.GGUFReader], source_reader: gguf.GGUFReader
) -> None:
    source_tensors = tensors_by_name(source_reader)
    shard_tensors = tensors_by_name(shard_readers[kind])
    stored = range(layers.start, layers.stop + LOOKAHEAD[kind])  # the lookahead layer is copied like the others
    expected_names = {
        name.replace(f"blk.{layer}.", f"blk.{layer - layers.start}.", 1)
        for name in source_tensors
        for layer in stored
        if name.startswith(f"blk.{layer}.")
    }
    assert {name for name in shard_tensors if name.startswith("blk.")} == expected_names
    assert len(expected_names) == 9 * len(stored)
    for layer in stored:
        for name, original in source_tensors.items():
            if not name.startswith(f"blk.{layer}."):
                continue
            copy = shard_tensors[name.replace(f"blk.{layer}.", f"blk.{layer - layers.start}.", 1)]
            assert copy.tensor_type == original.tensor_type, name
            assert copy.shape.tolist() == original.shape.tolist(), name  # ggml order: [576, 1536], not bytes
            assert copy.n_bytes == original.n_bytes, name
            assert copy.data.tobytes() == original.data.tobytes(), name
    quantized = [t for t in shard_tensors.values() if t.tensor_type == gguf.GGMLQuantizationType.Q4_1]
    assert len(quantized) == 7 * len(stored)


@pytest.mark.parametrize("kind", ["first", "last"])
def test_full_vocabulary_shards_keep_embeddings_and_norm(
    kind: str, shard_readers: dict[str, gguf.GGUFReader], source_reader: gguf.GGUFReader
) -> None:
    source_tensors = tensors_by_name(source_reader)
    shard_tensors = tensors_by_name(shard_readers[kind])
    non_block = {name for name in shard_tensors if not name.startswith("blk.")}
    assert non_block == {name for name in source_tensors if not name.startswith("blk.")}
    assert "output.weight" not in non_block  # the bundled model ties its head to token_embd
    for name in non_block:
        assert shard_tensors[name].tensor_type == source_tensors[name].tensor_type
        assert shard_tensors[name].shape.tolist() == source_tensors[name].shape.tolist()
        assert shard_tensors[name].data.tobytes() == source_tensors[name].data.tobytes()


def test_middle_shard_is_vocabulary_free_and_small(
    shard_paths: dict[str, pathlib.Path], shard_readers: dict[str, gguf.GGUFReader], source_reader: gguf.GGUFReader
) -> None:
    middle = shard_readers["middle"]
    assert field_value(middle, "tokenizer.ggml.model") == "none"
    assert field_value(middle, "llama.vocab_size") == 32
    assert len(field_value(middle, "tokenizer.ggml.tokens")) == 32
    assert field_value(middle, "tokenizer.ggml.token_type") == [int(gguf.TokenType.UNUSED)] * 32
    assert field_types(middle, "tokenizer.ggml.token_type") == field_types(source_reader, "tokenizer.ggml.token_type")
    tokenizer_keys = {key for key in middle.fields if key.startswith("tokenizer.")}
    assert tokenizer_keys == {"tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
    # everything outside the tokenizer is still copied
    kept = {key for key in source_reader.fields if not key.startswith("tokenizer.")} | kvpool_keys("middle")
    assert set(middle.fields) - tokenizer_keys == kept
    tensors = tensors_by_name(middle)
    embeddings = tensors["token_embd.weight"]
    assert embeddings.tensor_type == gguf.GGMLQuantizationType.F32
    assert embeddings.shape.tolist() == [N_EMBD, 32]
    assert not np.any(embeddings.data)
    assert "output.weight" not in tensors
    assert tensors["output_norm.weight"].data.tobytes() == tensors_by_name(source_reader)["output_norm.weight"].data.tobytes()
    sizes = {kind: path.stat().st_size for kind, path in shard_paths.items()}
    assert sizes["middle"] < 0.5 * sizes["first"]
    assert sizes["middle"] < 0.5 * sizes["last"]


@pytest.mark.parametrize(("kind", "n_vocab"), [("first", N_VOCAB), ("middle", 32), ("last", N_VOCAB)])
def test_each_shard_kind_loads_in_llama_cpp(kind: str, n_vocab: int, shard_paths: dict[str, pathlib.Path]) -> None:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(shard_paths[kind]).encode(), params)
    assert model, f"llama.cpp failed to load the {kind} shard"
    try:
        assert llama_cpp.llama_model_n_layer(model) == 10 + LOOKAHEAD[kind]
        assert llama_cpp.llama_model_n_embd(model) == N_EMBD
        assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)) == n_vocab
    finally:
        llama_cpp.llama_model_free(model)


def last_token_logits(model_path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=64, n_threads=1, n_threads_batch=1, logits_all=True, verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[len(tokens) - 1], copy=True)
    finally:
        llm.close()


def test_full_range_shard_reproduces_the_source_logits(tmp_path: pathlib.Path, source: pathlib.Path) -> None:
    info = write_shard(source, LayerRange(0, 30), tmp_path)
    assert info.path == tmp_path / f"{source.stem}.layers-00-30.gguf"
    assert info == read_shard_info(info.path)
    assert not info.vocab_free and info.shape.is_first and info.shape.is_last
    tokens = [1, 504, 3458, 282, 4649, 314, 1345, 30, 378, 2]
    expected = last_token_logits(source, tokens)
    actual = last_token_logits(info.path, tokens)
    assert expected.shape == (N_VOCAB,)
    assert np.array_equal(actual, expected)


def test_write_shard_reports_progress_and_writes_atomically(
    tmp_path: pathlib.Path, source: pathlib.Path, source_sha256: str
) -> None:
    messages: list[str] = []
    out = tmp_path / "nested" / "mid.gguf"
    info = write_shard(source, LayerRange(12, 13), out, source_sha256=source_sha256, progress=messages.append)
    # a given file hash is trusted, not recomputed; the layers' digests are
    assert messages == [f"reading {source.name}", "hashing source layers", "writing mid.gguf"]
    assert tree(tmp_path) == {"nested", "nested/mid.gguf"}
    assert info == read_shard_info(out)
    assert (info.shape.n_layers, info.vocab_free, info.shape.n_vocab) == (1, True, 32)


def test_write_shards_rejects_empty_and_repeated_ranges(tmp_path: pathlib.Path, source: pathlib.Path) -> None:
    with pytest.raises(ShardError, match="no layer ranges given"):
        write_shards(source, [], tmp_path / "out")
    with pytest.raises(ShardError, match="a layer range is given twice: 0:10,0:10"):
        write_shards(source, [LayerRange(0, 10), LayerRange(0, 10)], tmp_path / "out")
    with pytest.raises(ShardError, match="out of bounds"):
        write_shards(source, [LayerRange(0, 10), LayerRange(10, 40)], tmp_path / "out")
    assert tree(tmp_path) == set()


# --- tiny synthetic GGUFs -----------------------------------------------------------------------------------


def write_tiny_gguf(path: pathlib.Path, arch: str, *, n_layers: int = 4, n_embd: int = 8) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_custom_alignment(64)
    writer.add_uint32(f"{arch}.block_count", n_layers)
    writer.add_uint32(f"{arch}.embedding_length", n_embd)
    writer.add_array(f"{arch}.feed_forward_length", [16 * (layer + 1) for layer in range(n_layers)])
    writer.add_key_value(f"{arch}.some_int64", -5, gguf.GGUFValueType.INT64)
    writer.add_key_value(f"{arch}.some_float64", 0.1, gguf.GGUFValueType.FLOAT64)
    writer.add_bool(f"{arch}.some_flag", True)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d", "e"])
    writer.add_array("tokenizer.ggml.scores", [0.5, 0.25, 0.0, -1.0, 2.0])
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 4)
    writer.add_tensor("token_embd.weight", np.arange(5 * n_embd, dtype=np.float32).reshape(5, n_embd))
    for layer in range(n_layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.full(n_embd, layer, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", np.ones((5, n_embd), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_per_layer_arrays_and_custom_alignment_follow_the_range(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama")
    last = gguf.GGUFReader(write_shard(source, LayerRange(2, 4), tmp_path / "last.gguf").path)
    assert field_value(last, "llama.feed_forward_length") == [48, 64]
    assert field_value(last, "general.alignment") == 64
    assert last.alignment == 64
    assert field_value(last, "llama.some_int64") == -5
    assert field_types(last, "llama.some_float64") == [gguf.GGUFValueType.FLOAT64]
    assert field_value(last, "llama.some_flag") is True
    assert field_value(last, "tokenizer.ggml.merges") == ["a b"]
    tensors = tensors_by_name(last)
    assert sorted(tensors) == ["blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "output.weight", "output_norm.weight", "token_embd.weight"]
    assert tensors["blk.0.attn_norm.weight"].data.tolist() == [2.0] * 8

    middle_info = write_shard(source, LayerRange(1, 3), tmp_path / "middle.gguf")
    middle = gguf.GGUFReader(middle_info.path)
    assert (middle_info.shape.n_vocab, middle_info.vocab_free) == (32, True)
    assert field_value(middle, "llama.feed_forward_length") == [32, 48]
    assert field_value(middle, "tokenizer.ggml.scores") == [0.0] * 32
    assert "tokenizer.ggml.merges" not in middle.fields
    assert "tokenizer.ggml.bos_token_id" not in middle.fields
    assert sorted(tensors_by_name(middle)) == ["blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "output_norm.weight", "token_embd.weight"]

    first_info = write_shard(source, LayerRange(0, 2), tmp_path / "first.gguf")
    first = gguf.GGUFReader(first_info.path)
    assert (first_info.shape.n_layers, first_info.lookahead_layers) == (2, 1)
    assert field_value(first, "llama.block_count") == 3
    assert field_value(first, "llama.feed_forward_length") == [16, 32, 48]  # the lookahead layer's entry too
    first_tensors = tensors_by_name(first)
    assert sorted(name for name in first_tensors if name.startswith("blk.")) == [f"blk.{layer}.attn_norm.weight" for layer in range(3)]
    assert first_tensors["blk.2.attn_norm.weight"].data.tolist() == [2.0] * 8
    # a separate output head is the last shard's alone; the norm llama.cpp requires stays
    assert "output.weight" not in first_tensors and "output_norm.weight" in first_tensors


def test_read_shard_info_rejects_other_architectures(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    write_tiny_gguf(path, "gpt2")
    with pytest.raises(ShardError, match="architecture 'gpt2' is not supported; kvpool shards llama-family models only"):
        read_shard_info(path)


def test_a_first_shard_of_format_1_still_runs_and_the_shard_cache_cuts_it_again(
    tmp_path: pathlib.Path, source: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first shard written before lookahead layers (format 1, every row marked as an output) still
    loads and runs; the shard cache replaces it with one that has its lookahead layer."""
    ranges = [LayerRange(0, 2), LayerRange(2, 30)]
    with monkeypatch.context() as patch:
        patch.setattr(shard_contents, "lookahead_layers", lambda _total, _layers: 0)  # as an older kvpool wrote it
        old = cached_shards(source, ranges, root=tmp_path)[0]
    reader = gguf.GGUFReader(old.path)
    assert (field_value(reader, KEY_FORMAT), field_value(reader, "llama.block_count"), old.lookahead_layers) == (1, 2, 0)
    tokens = np.asarray([1, 504, 3458, 282], dtype=np.int32)
    with ShardModel(old.path) as model, model.new_context(16) as context:
        assert model.lookahead_layers == 0
        hidden = context.append(0, tokens=tokens).copy()
    new = cached_shards(source, ranges, root=tmp_path)[0]
    assert new.path == old.path and new.lookahead_layers == 1 and read_shard_info(new.path) == new
    with ShardModel(new.path) as model, model.new_context(16) as context:
        assert model.lookahead_layers == 1
        assert np.array_equal(context.append(0, tokens=tokens), hidden)  # every row, bit for bit


def test_file_sha256_streams_the_whole_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "blob"
    payload = os.urandom(3 * 1024 * 1024 + 17)
    path.write_bytes(payload)
    assert file_sha256(path) == hashlib.sha256(payload).hexdigest()


# --- CLI errors: exit 2, one line, nothing left behind ------------------------------------------------------


def assert_clean_failure(result: CliResult, message: str) -> None:
    assert result.code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("kvpool shard: error: ")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0]
    assert message in errors[0], errors[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "10:5", "-o", "{out}/x.gguf"], "layer range 10:5 is empty"),
        (["--layers", "ten:20", "-o", "{out}/x.gguf"], "bad layer range 'ten:20'"),
        (["--layers", "0:31", "-o", "{out}/x.gguf"], "out of bounds: the model has 30 layers"),
        (["--splits", "0:10,5:30", "-o", "{out}"], "splits overlap: 0:10 and 5:30"),
        (["--splits", "0:10,11:30", "-o", "{out}"], "splits leave a gap: layers 10:11"),
        (["--parts", "0", "-o", "{out}"], "cannot split into 0 parts"),
        (["--parts", "31", "-o", "{out}"], "cannot split 30 layers into 31 parts"),
        (["--parts", "3", "-o", "{blocker}"], "exists and is not a directory"),
        (["--layers", "0:10", "-o", "{blocker}/x.gguf"], "exists and is not a directory"),
    ],
)
def test_cli_rejects_bad_requests_on_the_bundled_model(tmp_path: pathlib.Path, argv: list[str], message: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory\n")
    out = tmp_path / "out"
    result = run_cli(*(arg.format(out=out, blocker=blocker) for arg in argv))
    assert_clean_failure(result, message)
    assert tree(tmp_path) == {"blocker"}
    assert blocker.read_text() == "not a directory\n"


def make_bad_source(kind: str, directory: pathlib.Path) -> pathlib.Path:
    path = directory / f"{kind}.gguf"
    match kind:
        case "missing":
            pass
        case "directory":
            path.mkdir()
        case "text":
            path.write_text("hello, this is not GGUF\n")
        case "empty":
            path.write_bytes(b"")
        case "truncated":
            with open(bundled_model_path(), "rb") as stream:
                path.write_bytes(stream.read(4096))  # cut inside the token list
        case "gpt2":
            write_tiny_gguf(path, "gpt2")
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "model file not found"),
        ("directory", "model path is not a file"),
        ("text", "is not a GGUF file (no GGUF magic number)"),
        ("empty", "is not a GGUF file (the file is empty)"),
        ("truncated", "is not a GGUF file (truncated header)"),
        ("gpt2", "architecture 'gpt2' is not supported; kvpool shards llama-family models only"),
    ],
)
@pytest.mark.parametrize("mode", [["--layers", "0:2"], ["--parts", "2"]], ids=["layers", "parts"])
def test_cli_rejects_bad_sources(tmp_path: pathlib.Path, kind: str, message: str, mode: list[str]) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    source = make_bad_source(kind, inputs)
    before = tree(tmp_path)
    result = run_cli(source, *mode, "-o", tmp_path / "out" / "x")
    assert_clean_failure(result, message)
    assert tree(tmp_path) == before


def test_cli_refuses_to_reshard_a_shard(tmp_path: pathlib.Path, shard_paths: dict[str, pathlib.Path]) -> None:
    result = run_cli(shard_paths["middle"], "--layers", "0:5", "-o", tmp_path / "x.gguf")
    assert_clean_failure(result, "is already a kvpool shard (layers [10, 20) of 30); shard the original model instead")
    assert tree(tmp_path) == set()


def test_cli_refuses_to_overwrite_its_source(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama")
    before = source.read_bytes()
    result = run_cli(source, "--layers", "0:2", "-o", source)
    assert_clean_failure(result, "is the source model itself")
    assert source.read_bytes() == before


def test_failed_partial_write_removes_every_partial_file(tmp_path: pathlib.Path, source: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # a directory where the second shard's partial file must go makes its write fail after the first is done
    blocker = out / f".{source.stem}.layers-15-30.gguf.partial-{os.getpid()}"
    blocker.mkdir()
    result = run_cli("--splits", "0:15,15:30", "-o", out)
    assert_clean_failure(result, "cannot write")
    assert tree(out) == {blocker.name}


def test_failed_publish_removes_shards_already_renamed_into_place(tmp_path: pathlib.Path, source: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # a directory under the second shard's final name makes its rename fail after the first shard is in place
    blocker = out / f"{source.stem}.layers-15-30.gguf"
    blocker.mkdir()
    result = run_cli("--splits", "0:15,15:30", "-o", out)
    assert_clean_failure(result, f"cannot write {blocker}")
    assert tree(out) == {blocker.name}


def test_cli_layers_writes_one_shard(tmp_path: pathlib.Path, source_sha256: str) -> None:
    out = tmp_path / "new" / "mid.gguf"
    result = run_cli("--layers", "10:20", "-o", out)
    assert result.code == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.split("\t") == [str(out), "10:20", str(out.stat().st_size), file_sha256(out)]
    assert read_shard_info(out).source_sha256 == source_sha256
    assert tree(tmp_path) == {"new", "new/mid.gguf"}

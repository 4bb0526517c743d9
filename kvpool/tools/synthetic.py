"""Random-weight llama GGUFs of a chosen shape and type, written in seconds: the zoo the exactness tests
and the benchmark run on beside the bundled model.

gguf-py writes a base file (matrices F16, norms and rope factors F32); every other type comes from
llama.cpp's own quantizer (`llama_model_quantize`), so each file is what llama.cpp itself would write.
The vocabulary is the bundled model's (its `tokenizer.*` keys, so prompts tokenize as with the bundled
model) or a small synthetic SentencePiece one with BOS. Files are cached under
<work dir>/models/<name>-<key>/, the key a hash of every parameter and of GENERATOR_VERSION.

Weights are `normal * gain / sqrt(fan_in)` and norms 1: with `normal * 0.02` a tied-embedding model
repeats one token forever, which would make an exactness test on greedy ids pass vacuously.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
from collections.abc import Callable, Iterator

import gguf
import llama_cpp
import numpy as np

from kvpool.host import work_dir
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.contents import field_value
from kvpool.shard.errors import ShardError

GENERATOR_VERSION = 1
LLAMA_CPP_LOGGER = "llama-cpp-python"
BASE_TYPE = "F16"
FILE_TYPES = {
    "F32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "Q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
}
BUNDLED_VOCAB = "bundled"
SPM_VOCAB = "spm"
SPM_BOS_ID = 1
_SPM_SPECIALS = ("<unk>", "<s>", "</s>")
_SPM_WORDS = (
    "the of and to in is that it for was on are as with be at by this have from or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some so these "
    "would other into has more her two like him see time could no make than first been its who now people my made "
    "over did down only way find use may water long little very after words called just where most know capital "
    "France poem sea wind lighthouse keeper counts waves night write short name three colors"
).split()


@dataclasses.dataclass(frozen=True, slots=True)
class Rope:
    """Rope variants: the frequency base, linear scaling (factor > 1), llama-3's `rope_freqs` tensor."""

    freq_base: float = 10000.0
    linear_factor: float = 1.0
    llama3_freqs: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ZooSpec:
    """The shape of one random-weight llama. `n_head_kv` as a tuple is stored as a per-layer array;
    `head_dim` set writes `attention.key_length`/`value_length` (n_embd need not be n_head * head_dim)."""

    name: str
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int | tuple[int, ...] = 2
    head_dim: int | None = None
    n_ff: int = 512
    tied_output: bool = True
    rope: Rope = Rope()
    vocab: str = BUNDLED_VOCAB
    gain: float = 1.5
    seed: int = 0
    context_length: int = 4096

    def __post_init__(self) -> None:
        if self.vocab not in (BUNDLED_VOCAB, SPM_VOCAB):
            raise ShardError(f"unknown vocabulary {self.vocab!r}: {BUNDLED_VOCAB} or {SPM_VOCAB}")
        if isinstance(self.n_head_kv, tuple) and len(self.n_head_kv) != self.n_layer:
            raise ShardError(f"{self.name}: {len(self.n_head_kv)} per-layer KV head counts for {self.n_layer} layers")
        if min(self.n_layer, self.n_embd, self.n_head, self.n_ff, *self.head_counts_kv) < 1:
            raise ShardError(f"{self.name}: layers, widths and head counts must be at least 1")
        if any(self.n_head % heads for heads in self.head_counts_kv):
            raise ShardError(f"{self.name}: {self.n_head} query heads do not split into groups of {self.n_head_kv}")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ShardError(f"{self.name}: n_embd {self.n_embd} is not a multiple of {self.n_head} heads")

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def head_counts_kv(self) -> tuple[int, ...]:
        return self.n_head_kv if isinstance(self.n_head_kv, tuple) else (self.n_head_kv,) * self.n_layer

    def key(self) -> str:
        """A hash of every parameter: a changed parameter or generator is another file."""
        text = json.dumps([GENERATOR_VERSION, dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def zoo_model(spec: ZooSpec, file_type: str = BASE_TYPE, *, root: pathlib.Path | None = None, threads: int = 1) -> pathlib.Path:
    """The GGUF of `spec` in `file_type` (a FILE_TYPES name), built once and reused from the cache;
    `threads` quantize (a ~1B model takes minutes on one)."""
    if file_type not in FILE_TYPES:
        raise ShardError(f"unknown file type {file_type!r}: one of {', '.join(FILE_TYPES)}")
    directory = (root or work_dir() / "models") / f"{spec.name}-{spec.key()}"
    target = directory / f"{spec.name}.{file_type}.gguf"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    base = directory / f"{spec.name}.{BASE_TYPE}.gguf"
    if not base.is_file():
        _publish(base, lambda partial: write_base_model(spec, partial))
    if file_type != BASE_TYPE:
        _publish(target, lambda partial: quantize(base, partial, file_type, threads=threads))
    return target


def _publish(target: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Write through a partial file renamed into place: a reader never sees half a model."""
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def quantize(source: pathlib.Path, out: pathlib.Path, file_type: str, *, threads: int = 1) -> None:
    """llama.cpp's own quantizer, with its defaults (Q4_K_M mixes Q4_K and Q6_K as llama.cpp decides)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.nthread = threads
    with _llama_errors_only():
        failed = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(out), params) != 0
    if failed:
        raise ShardError(f"llama.cpp could not quantize {source.name} to {file_type}")


@contextlib.contextmanager
def _llama_errors_only() -> Iterator[None]:
    """llama-cpp-python's log filter at errors while the quantizer prints a line per tensor."""
    logger = logging.getLogger(LLAMA_CPP_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---- the base file ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, fan_in)
    dtype: type
    make: Callable[[], np.ndarray]


def write_base_model(spec: ZooSpec, path: pathlib.Path) -> None:
    """Write `spec` as a GGUF with F16 matrices, one tensor generated at a time (a ~1B model fits in memory)."""
    vocabulary = _vocabulary(spec)
    n_vocab = len(vocabulary["tokenizer.ggml.tokens"][0])
    tensors = list(_tensors(spec, n_vocab))
    writer = gguf.GGUFWriter(path, "llama")
    try:
        _add_hyperparameters(writer, spec, n_vocab)
        for key, (value, value_type, sub_type) in vocabulary.items():
            writer.add_key_value(key, value, value_type, sub_type)
        for tensor in tensors:
            nbytes = math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(tensor.dtype), nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in tensors:
            writer.write_tensor_data(tensor.make())
    finally:
        writer.close()


def _add_hyperparameters(writer: gguf.GGUFWriter, spec: ZooSpec, n_vocab: int) -> None:
    writer.add_name(f"kvpool zoo {spec.name}")
    writer.add_file_type(int(llama_cpp.LLAMA_FTYPE_MOSTLY_F16))
    writer.add_block_count(spec.n_layer)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    if isinstance(spec.n_head_kv, tuple):
        writer.add_key_value("llama.attention.head_count_kv", list(spec.n_head_kv), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    else:
        writer.add_head_count_kv(spec.n_head_kv)
    if spec.head_dim is not None:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_size)
    writer.add_rope_freq_base(spec.rope.freq_base)
    if spec.rope.linear_factor != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope.linear_factor)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)


def _tensors(spec: ZooSpec, n_vocab: int) -> Iterator[_Tensor]:
    """Every tensor in the order llama.cpp's converter writes them (the order does not change the values)."""
    q_width = spec.n_head * spec.head_size
    yield _matrix(spec, "token_embd.weight", n_vocab, spec.n_embd)
    if spec.rope.llama3_freqs:
        yield _Tensor("rope_freqs.weight", (spec.head_size // 2,), np.float32, lambda: _llama3_rope_factors(spec))
    for layer, heads_kv in enumerate(spec.head_counts_kv):
        prefix = f"blk.{layer}."
        kv_width = heads_kv * spec.head_size
        yield _norm(prefix + "attn_norm.weight", spec.n_embd)
        yield _matrix(spec, prefix + "attn_q.weight", q_width, spec.n_embd)
        yield _matrix(spec, prefix + "attn_k.weight", kv_width, spec.n_embd)
        yield _matrix(spec, prefix + "attn_v.weight", kv_width, spec.n_embd)
        yield _matrix(spec, prefix + "attn_output.weight", spec.n_embd, q_width)
        yield _norm(prefix + "ffn_norm.weight", spec.n_embd)
        yield _matrix(spec, prefix + "ffn_gate.weight", spec.n_ff, spec.n_embd)
        yield _matrix(spec, prefix + "ffn_up.weight", spec.n_ff, spec.n_embd)
        yield _matrix(spec, prefix + "ffn_down.weight", spec.n_embd, spec.n_ff)
    yield _norm("output_norm.weight", spec.n_embd)
    if not spec.tied_output:
        yield _matrix(spec, "output.weight", n_vocab, spec.n_embd)


def _matrix(spec: ZooSpec, name: str, rows: int, fan_in: int) -> _Tensor:
    def make() -> np.ndarray:
        # one generator per tensor, seeded by its name: values do not depend on what else the model holds
        seed = int.from_bytes(hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()[:8], "little")
        values = np.random.default_rng(seed).standard_normal((rows, fan_in), dtype=np.float32)
        return (values * (spec.gain / math.sqrt(fan_in))).astype(np.float16)

    return _Tensor(name, (rows, fan_in), np.float16, make)


def _norm(name: str, size: int) -> _Tensor:
    return _Tensor(name, (size,), np.float32, lambda: np.ones(size, dtype=np.float32))


def _llama3_rope_factors(spec: ZooSpec) -> np.ndarray:
    """Llama-3.1's frequency divisors (factor 8, low 1, high 4, trained on 8192 positions), as its converter writes them."""
    factor, low_freq_factor, high_freq_factor, original_context = 8.0, 1.0, 4.0, 8192
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    dims = np.arange(0, spec.head_size, 2, dtype=np.float64)
    wavelens = 2 * math.pi * spec.rope.freq_base ** (dims / spec.head_size)
    smooth = (original_context / wavelens - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelens < high_wavelen, 1.0, np.where(wavelens > low_wavelen, factor, blended))
    return factors.astype(np.float32)


# ---- vocabularies ----------------------------------------------------------------------------------------------

Vocabulary = dict[str, tuple[object, gguf.GGUFValueType, gguf.GGUFValueType | None]]


def _vocabulary(spec: ZooSpec) -> Vocabulary:
    return _bundled_vocabulary() if spec.vocab == BUNDLED_VOCAB else _spm_vocabulary()


def _bundled_vocabulary() -> Vocabulary:
    """The bundled model's tokenizer keys, copied with their types: prompts tokenize as with that model."""
    reader = gguf.GGUFReader(bundled_model_path())
    return {key: field_value(key, field) for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def _spm_vocabulary() -> Vocabulary:
    """A small SentencePiece ("llama") vocabulary: <unk>, <s> (BOS, added), </s>, the 256 byte tokens, then
    letters and words with and without the word-start mark; longer pieces score higher, so they merge first."""
    array, string, int32, float32 = (
        gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32, gguf.GGUFValueType.FLOAT32,
    )
    pieces = [*_SPM_SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, *[gguf.TokenType.BYTE] * 256]
    normal = ["\u2581"]
    for text in [*(chr(c) for c in range(33, 127)), *_SPM_WORDS]:
        for piece in (text, "\u2581" + text):
            if piece not in normal:
                normal.append(piece)
    pieces += normal
    types += [gguf.TokenType.NORMAL] * len(normal)
    scores = [0.0] * (len(pieces) - len(normal)) + [float(len(piece)) for piece in normal]
    uint32, boolean = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.BOOL
    return {
        "tokenizer.ggml.model": ("llama", string, None),
        "tokenizer.ggml.tokens": ([piece.encode() for piece in pieces], array, string),
        "tokenizer.ggml.scores": (scores, array, float32),
        "tokenizer.ggml.token_type": ([int(t) for t in types], array, int32),
        "tokenizer.ggml.unknown_token_id": (0, uint32, None),
        "tokenizer.ggml.bos_token_id": (SPM_BOS_ID, uint32, None),
        "tokenizer.ggml.eos_token_id": (2, uint32, None),
        "tokenizer.ggml.add_bos_token": (True, boolean, None),
        "tokenizer.ggml.add_eos_token": (False, boolean, None),
        "tokenizer.ggml.add_space_prefix": (True, boolean, None),
    }


# ---- the zoo ---------------------------------------------------------------------------------------------------

# Tiny shapes the exactness tests run on, one of each kind (n_embd 256 so that K-quants apply to every matrix).
ZOO = (
    ZooSpec("gqa", n_layer=6, n_head=8, n_head_kv=2),
    ZooSpec("mha", n_head=4, n_head_kv=4, tied_output=False, rope=Rope(linear_factor=4.0)),
    ZooSpec("mqa", n_layer=5, n_head=8, n_head_kv=1, tied_output=False, rope=Rope(freq_base=500000.0, llama3_freqs=True)),
    ZooSpec("head128", n_head=4, n_head_kv=(2, 2, 2, 2), head_dim=128, tied_output=False, vocab=SPM_VOCAB),
)
ZOO_TYPES = ("F16", "Q8_0", "Q6_K", "Q5_0", "Q4_K_M")
# About 1.2B parameters (Q4_K_M: about 0.7 GB): a realistic size for the benchmark, built once like the zoo.
LLAMA_1B = ZooSpec("llama-1b", n_layer=22, n_embd=2048, n_head=32, n_head_kv=4, n_ff=5632, tied_output=False, rope=Rope(freq_base=500000.0))


def describe(spec: ZooSpec) -> str:
    heads = "x".join(map(str, sorted(set(spec.head_counts_kv))))
    parts = [
        f"{spec.n_layer} layers", f"n_embd {spec.n_embd}", f"heads {spec.n_head}/{heads}" + (" (array)" if isinstance(spec.n_head_kv, tuple) else ""),
        f"head_dim {spec.head_size}" + (" (explicit)" if spec.head_dim is not None else ""), f"n_ff {spec.n_ff}",
        "tied head" if spec.tied_output else "separate head", f"rope base {spec.rope.freq_base:g}",
    ]
    if spec.rope.linear_factor != 1.0:
        parts.append(f"linear x{spec.rope.linear_factor:g}")
    if spec.rope.llama3_freqs:
        parts.append("rope_freqs")
    parts.append(f"vocab {spec.vocab}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Build (or find in the cache) every zoo model, or the ~1B benchmark model, printing one row per file."""
    import argparse
    import time

    parser = argparse.ArgumentParser(
        prog="python -m kvpool.tools.synthetic",
        description="Write random-weight llama GGUFs (gguf-py writes F16 tensors with the bundled model's tokenizer; "
        "llama.cpp's own quantizer makes the other types) under <work dir>/models, built once and reused.",
    )
    parser.add_argument("--llama-1b", action="store_true", help=f"only the ~1B benchmark model ({describe(LLAMA_1B)}) in --type")
    parser.add_argument("--type", default="Q4_K_M", choices=FILE_TYPES, help="file type of --llama-1b (default Q4_K_M)")
    parser.add_argument("--threads", type=int, default=1, help="quantizer threads (default 1)")
    args = parser.parse_args(argv)
    builds = [(LLAMA_1B, args.type)] if args.llama_1b else [(spec, file_type) for spec in ZOO for file_type in ZOO_TYPES]
    print(f"{'model':<10} {'type':<7} {'MiB':>7} {'build s':>8}  shape")
    for spec, file_type in builds:
        started = time.perf_counter()
        path = zoo_model(spec, file_type, threads=args.threads)
        seconds = time.perf_counter() - started
        print(f"{spec.name:<10} {file_type:<7} {path.stat().st_size / 2**20:>7.1f} {seconds:>8.2f}  {describe(spec)}", flush=True)
        if args.llama_1b:
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

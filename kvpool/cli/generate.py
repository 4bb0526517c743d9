"""`kvpool generate`: greedy text generation through a chain of shards run in this process."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from kvpool.local.chain import LocalChain
from kvpool.local.generate import greedy_tokens
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.bundled import BundledModelMissing, bundled_model_path
from kvpool.shard.cache import shards_in_directory, shards_in_parts
from kvpool.shard.errors import ShardError
from kvpool.shard.header import ShardInfo
from kvpool.shard.route import check_route

DEFAULT_PROMPT = "What is the capital of France?"


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "generate",
        help="generate text greedily through a chain of shards in one process",
        description=(
            "Greedy generation through a chain of layer shards run in this process: the first shard takes "
            "token ids, each later shard takes the previous one's hidden states, the last returns logits. "
            "By default the bundled SmolLM2-135M model is cut into 3 shards (kept under the work directory)."
        ),
    )
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--model", type=pathlib.Path, help="source GGUF (default: the bundled model)")
    route = parser.add_mutually_exclusive_group()
    route.add_argument("--shards", type=pathlib.Path, metavar="DIR", help="use the shard files in DIR")
    route.add_argument("--parts", type=int, default=3, metavar="N", help="cut the model into N even shards (default 3)")
    parser.add_argument("--max-tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    parser.add_argument("--ids", action="store_true", help="also print the generated token ids, one per line")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--threads", type=int, default=1, help="llama threads per shard (default 1)")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context length per shard (default 2048)")
    parser.set_defaults(func=run)


def _route(args: argparse.Namespace, source: pathlib.Path) -> list[ShardInfo]:
    if args.shards is not None:
        if not args.shards.is_dir():
            raise ShardError(f"shard directory not found: {args.shards}")
        shards = shards_in_directory(args.shards)
    else:
        shards = shards_in_parts(source, args.parts, progress=_progress)
    check_route(shards)
    return shards


def _progress(message: str) -> None:
    print(f"kvpool: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        source = args.model or bundled_model_path()
        if args.max_tokens < 1 or args.n_ctx < 1 or args.threads < 1:
            raise ShardError("--max-tokens, --n-ctx and --threads must be positive")
        shards = _route(args, source)
    except (ShardError, BundledModelMissing) as error:
        print(f"kvpool generate: error: {error}", file=sys.stderr)
        return 2
    for shard in shards:
        _progress(f"shard [{shard.shape.layer_start:2d}, {shard.shape.layer_stop:2d}) {shard.path}")
    with Tokenizer(shards[0].path) as tokenizer, LocalChain(
        [shard.path for shard in shards], n_threads=args.threads
    ) as chain, chain.new_session(args.n_ctx) as session:
        prompt_text = args.prompt if args.raw else tokenizer.chat_prompt(args.prompt)
        prompt = tokenizer.encode(prompt_text)
        if len(prompt) + args.max_tokens > args.n_ctx:
            print(f"kvpool generate: error: prompt ({len(prompt)}) + --max-tokens exceed --n-ctx", file=sys.stderr)
            return 2
        started = time.perf_counter()
        tokens = greedy_tokens(session.append, prompt, args.max_tokens, is_end=tokenizer.is_end_of_generation)
        generated = tokenizer.stream(tokens, sys.stdout)
        elapsed = time.perf_counter() - started
        if args.ids:
            for token in generated:
                print(token)
        _progress(
            f"{len(generated)} tokens after a {len(prompt)}-token prompt in {elapsed:.2f} s "
            f"through {len(shards)} shard{'s' if len(shards) > 1 else ''} ({len(generated) / elapsed:.1f} tok/s)"
        )
    return 0

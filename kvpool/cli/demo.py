"""`kvpool demo`: the main job on the embedded default. Cut the bundled model into shards, start one
`kvpool serve` daemon per shard, generate text through them as a router would, show their state, stop."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

from kvpool.cli.status import render
from kvpool.client.client import KvpoolError
from kvpool.launcher import DaemonStartFailed, start_daemons
from kvpool.local.tokenizer import Tokenizer
from kvpool.router.router import RecoveryFailed, Router
from kvpool.shard.bundled import BundledModelMissing, bundled_model_path
from kvpool.shard.cache import shards_in_parts
from kvpool.shard.errors import ShardError

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper."


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="cut the model into shards, serve each with a daemon, generate through them",
        description=(
            "The main job on the embedded default: the bundled SmolLM2-135M model is cut into --parts shards, "
            "one `kvpool serve` daemon per shard is started, and text is generated greedily through the route "
            "of daemons (token ids into the first, hidden states between them, logits from the last). "
            "Then each daemon's session table is shown, the session released and the daemons stopped."
        ),
    )
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--model", type=pathlib.Path, help="source GGUF (default: the bundled model)")
    parser.add_argument("--parts", type=int, default=3, help="shards, one daemon each (default 3)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate (default 48)")
    parser.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    parser.add_argument("--ids", action="store_true", help="also print the generated token ids, one per line")
    parser.add_argument("--quiet", action="store_true", help="print only the generated text")
    parser.set_defaults(func=run)


def _say(message: str) -> None:
    print(f"kvpool demo: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        source = args.model or bundled_model_path()
        shards = shards_in_parts(source, args.parts, progress=_say)
    except (ShardError, BundledModelMissing) as error:
        print(f"kvpool demo: error: {error}", file=sys.stderr)
        return 2
    # One llama thread per daemon: the daemons of a route compute one after the other for one session.
    options = ["--threads", "1", "--max-sessions", "2", "--n-ctx", "1024", "--ttl", "60"]
    socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-demo-"))
    _say(f"starting {len(shards)} daemons (sockets in {socket_dir})")
    started = time.perf_counter()
    try:
        daemons = start_daemons([shard.path for shard in shards], socket_dir, options)
    except DaemonStartFailed as error:
        print(f"kvpool demo: error: {error}", file=sys.stderr)
        return 1
    try:
        for daemon, shard in zip(daemons, shards):
            _say(f"daemon pid {daemon.process.pid} serves {shard.shape} on {daemon.socket.name}")
        _say(f"daemons ready in {time.perf_counter() - started:.1f} s")
        clients = [daemon.client() for daemon in daemons]
        try:
            return _generate(args, shards[0].path, Router(clients))
        except (KvpoolError, RecoveryFailed) as error:
            print(f"kvpool demo: error from a daemon: {error}", file=sys.stderr)
            return 1
        finally:
            for client in clients:
                client.close()
    finally:
        codes = [daemon.stop() for daemon in daemons]
        _say(f"daemons stopped (exit codes {codes})")
        for daemon in daemons:
            daemon.log_path.unlink(missing_ok=True)
        try:
            os.rmdir(socket_dir)
        except OSError:
            pass


def _generate(args: argparse.Namespace, tokenizer_path: pathlib.Path, router: Router) -> int:
    session = router.session(f"demo-{os.getpid()}")
    with Tokenizer(tokenizer_path) as tokenizer:
        prompt = tokenizer.encode(args.prompt if args.raw else tokenizer.chat_prompt(args.prompt))
        _say(f"session ({session.session_id!r}, epoch {session.epoch}): {len(prompt)} prompt tokens through {len(router.clients)} daemons")
        stamps: list[float] = [time.perf_counter()]

        def timed(tokens):
            for token in tokens:
                stamps.append(time.perf_counter())
                yield token

        # greedy, picked on the last daemon: a token id crosses the last hop, not n_vocab logits
        tokens = session.generate(prompt, args.max_tokens, is_end=tokenizer.is_end_of_generation)
        generated = tokenizer.stream(timed(tokens), sys.stdout)
        if args.ids:
            for token in generated:
                print(token)
    first = stamps[1] - stamps[0] if len(stamps) > 1 else 0.0
    decode = f", then {(len(stamps) - 2) / (stamps[-1] - stamps[1]):.1f} tok/s decoding" if len(stamps) > 2 else ""
    _say(f"{len(generated)} tokens: prefill and first token {first * 1000:.0f} ms{decode} (steady state, sampled on the last shard)")
    if not args.quiet:
        for index, client in enumerate(router.clients):
            print(f"\n--- daemon {index}: kvpool status ---", file=sys.stderr)
            print(render(client.stats()), file=sys.stderr)
    session.release()
    return 0

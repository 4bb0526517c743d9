"""The layout change of issue 18, as it was run: `git mv` every module into its subsystem's folder, then rewrite
every dotted module name (imports, strings, docstrings) in the Python files of the repository.

    python evidence/layout/move.py            # from the repository root, on a clean tree

Only modules move; what splits or merges is done by hand in the commits after this one.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

KVPOOL = {
    # the wire: what crosses a socket
    "protocol": "wire.protocol",
    "shard_shape": "wire.shape",
    "append_checks": "wire.checks",
    "errors": "wire.errors",
    # shard files
    "layer_ranges": "shard.ranges",
    "gguf_header": "shard.header",
    "shard_contents": "shard.contents",
    "shard_writer": "shard.writer",
    "shard_error": "shard.errors",
    "shardcache": "shard.cache",
    "bundled": "shard.bundled",
    # the daemon
    "supervisor": "daemon.supervisor",
    "server": "daemon.transport.frames",
    "listener": "daemon.transport.listener",
    "byte_allowance": "daemon.transport.allowance",
    "service": "daemon.service",
    "gate": "daemon.gate",
    "warm_requests": "daemon.warm",
    "housekeeping": "daemon.housekeeping",
    "status": "daemon.status",
    "metrics": "daemon.metrics",
    "config": "daemon.config",
    "mode_probe": "daemon.mode_probe",
    "lifeline": "daemon.lifeline",
    "gpu": "daemon.gpu",
    "books": "daemon.books.books",
    "budget": "daemon.books.budget",
    "sessions": "daemon.books.sessions",
    "spill": "daemon.books.spill",
    "integrity": "daemon.books.integrity",
    "pool": "daemon.pool.pool",
    "pool_spec": "daemon.pool.spec",
    "worker_handle": "daemon.pool.handle",
    "worker_process": "daemon.pool.process",
    "worker_errors": "daemon.pool.errors",
    "worker_segment": "daemon.pool.segment",
    "worker_controls": "daemon.pool.controls",
    "segments": "daemon.pool.segments",
    "worker_lifecycle": "daemon.pool.lifecycle",
    "channels": "daemon.pool.channels",
    "compute": "daemon.pool.compute",
    "batched_worker": "daemon.pool.batched",
    "admission": "daemon.admission.admission",
    "admission_queue": "daemon.admission.queue",
    "parking": "daemon.admission.parking",
    "calibration": "daemon.admission.calibration",
    "residency": "daemon.admission.residency",
    # the clients
    "client": "client.client",
    "async_client": "client.aio",
    "client_connection": "client.connection",
    "client_channels": "client.channels",
    "client_messages": "client.messages",
    # the router
    "router": "router.router",
    "routed_session": "router.session",
    "route": "router.route",
    "recovery": "router.recovery",
    "in_flight_append": "router.in_flight",
    "append_history": "router.history",
    # the in-process chain
    "chain": "local.chain",
    "generate": "local.generate",
    "tokenizer": "local.tokenizer",
    # the command line
    "cli": "cli.main",
    "cli_bench": "cli.bench",
    "cli_demo": "cli.demo",
    "cli_generate": "cli.generate",
    "cli_serve": "cli.serve",
    "cli_shard": "cli.shard",
    "cli_status": "cli.status",
    "cli_stress": "cli.stress",
}

WORKERS = {
    # llama.cpp wrappers
    "runtime": "runtime.model",
    "context": "runtime.context",
    "context_params": "runtime.params",
    "layout": "runtime.shard",
    "native": "runtime.native",
    "sequence_state": "runtime.state",
    "sampling": "runtime.sampling",
    "errors": "runtime.errors",
    "batched": "runtime.batched",
    "batch_plan": "runtime.batch_plan",
    "batched_checks": "runtime.batch_checks",
    "ubatch_decoder": "runtime.ubatch",
    # the worker process
    "process": "server.main",
    "commands": "server.commands",
    "direct": "server.direct",
    "direct_cancels": "server.direct_cancels",
    "direct_words": "server.direct_words",
    "batched_server": "server.batched_server",
    "compute_locks": "server.compute_locks",
}

FILES_BESIDE = {"workers/capture.c": "workers/runtime/capture.c"}


def run(*command: str) -> None:
    subprocess.run(command, check=True)


def moves() -> dict[str, str]:
    """Old dotted module name -> new one."""
    table = {f"kvpool.{old}": f"kvpool.{new}" for old, new in KVPOOL.items()}
    table |= {f"workers.{old}": f"workers.{new}" for old, new in WORKERS.items()}
    return table


def move_files(table: dict[str, str]) -> None:
    folders = {new.rsplit(".", 1)[0] for new in table.values()}
    for folder in sorted(folders):
        path = pathlib.Path(folder.replace(".", "/"))
        path.mkdir(parents=True, exist_ok=True)
        init = path / "__init__.py"
        if not init.exists():
            init.write_text(f'"""{folder}."""\n')
            run("git", "add", str(init))
    for old, new in table.items():
        run("git", "mv", old.replace(".", "/") + ".py", new.replace(".", "/") + ".py")
    for old, new in FILES_BESIDE.items():
        run("git", "mv", old, new)


def rewrite(table: dict[str, str]) -> None:
    # Longest names first, and only whole dotted names: kvpool.client must not touch kvpool.client_messages.
    pattern = re.compile(r"\b(" + "|".join(re.escape(old) for old in sorted(table, key=len, reverse=True)) + r")\b(?![\w])")
    # `from kvpool import cli_bench, stress` and `from workers import x`: module names imported from the package
    from_package = re.compile(r"^(\s*)from (kvpool|workers) import ([\w, ]+)$", re.M)
    for path in [*pathlib.Path("kvpool").rglob("*.py"), *pathlib.Path("workers").rglob("*.py"),
                 *pathlib.Path("tests").rglob("*.py"), *pathlib.Path("scripts").rglob("*.py"), pathlib.Path("setup.py")]:
        text = path.read_text()

        def package_import(match: re.Match) -> str:
            indent, package, names = match.groups()
            lines = []
            kept = []
            for name in (n.strip() for n in names.split(",")):
                full = f"{package}.{name}"
                if full in table:
                    parent, leaf = table[full].rsplit(".", 1)
                    lines.append(f"{indent}from {parent} import {leaf}" + (f" as {name}" if leaf != name else ""))
                else:
                    kept.append(name)
            if kept:
                lines.insert(0, f"{indent}from {package} import {', '.join(kept)}")
            return "\n".join(lines)

        # the dotted pass first: the lines written for package imports already name the new modules
        new = pattern.sub(lambda match: table[match.group(1)], text)
        new = from_package.sub(package_import, new)
        if new != text:
            path.write_text(new)


def main() -> int:
    table = moves()
    move_files(table)
    rewrite(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

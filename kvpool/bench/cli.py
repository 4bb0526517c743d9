"""One whole run (`run_bench`: every section, then JSON and PNG) and the command line of `kvpool bench`."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np
import psutil

from kvpool.bench.admission import measure_admission, measure_memory
from kvpool.bench.chart import write_chart
from kvpool.bench.checks import LoadMeter, contended_lines, round_spreads
from kvpool.bench.durable import measure_durable, tokens_needed
from kvpool.bench.move import measure_move, moved_split
from kvpool.bench.one_session import measure_mid_shard, measure_route
from kvpool.bench.options import BENCH_KEEP_WARM_S, BenchOptions, bench_say, check_threads, write_results
from kvpool.bench.overload import measure_overload
from kvpool.bench.parallel import measure_parallel
from kvpool.bench.prefix import measure_prefix
from kvpool.bench.report import summarize
from kvpool.bench.rig import PROMPTS, Rig, long_history
from kvpool.bench.rigs import MAX_RIGS, check_rigs, run_rigs
from kvpool.bench.startup import measure_startup
from kvpool.bench.table import render_table
from kvpool.bench.warm import measure_warm
from kvpool.daemon.keep_warm import check_keep_warm
from kvpool.host import work_dir
from kvpool.local.tokenizer import Tokenizer
from kvpool.shard.bundled import bundled_model_path
from kvpool.shard.cache import cached_shards, shards_in_parts
from kvpool.shard.header import ShardInfo, file_sha256
from workers.runtime.huge_pages import transparent_huge_pages
from workers.server.readings import huge_page_bytes


def _cpu_model() -> str:
    """/proc/cpuinfo's first "model name" (what lscpu prints), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(source: pathlib.Path) -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "uname": " ".join(platform.uname()),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "model": str(source),
        "model_sha256": file_sha256(source),
        "load_average_at_start": os.getloadavg(),
        # the bench's own references collapse their loads into huge pages as a daemon's workers do (--huge-pages auto)
        "transparent_huge_pages": transparent_huge_pages(),
    }


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine spent running code since boot (user, nice, system, interrupts)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0.0) + getattr(times, "softirq", 0.0)


def _own_tree_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _jsonable(value):
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, pathlib.Path):
        return str(value)
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def run_bench(options: BenchOptions) -> tuple[dict, str]:
    """Run every section; write <out>/bench[-quick].{json,png}; return the results and the table."""
    env = environment(options.model)
    started = time.perf_counter()
    busy_before, ours_before = _busy_cpu_s(), _own_tree_cpu_s()
    rig = Rig(options)
    try:
        results = {
            "environment": env,
            "options": dataclasses.asdict(options),
            "daemons": {"start_s": rig.daemon_start_s, "options": rig.daemon_options},
            "shards": {shard.path.name: file_sha256(shard.path) for shard in rig.shards},
        }
        meter = LoadMeter()
        results.update(_one_session_sections(rig, meter))
        bench_say("section 3: four sessions at once")
        with meter.section("parallel"):
            results["parallel"] = measure_parallel(rig)
        bench_say("section 5: admission and reclaim")
        with meter.section("admission"):
            results["admission"] = measure_admission(rig)
        bench_say("section 6: memory")
        with meter.section("memory"):
            results["memory"] = measure_memory(rig)
        for name in OWN_DAEMON_SECTIONS:
            with meter.section(name):
                results[name] = _run_own_section(name, rig.shards, rig.tokenizer, rig.socket_dir, options)
        results["load"] = meter.loads
    finally:
        rig.close()
    results = _jsonable(results)
    env["load_average_at_end"] = os.getloadavg()
    env["huge_page_bytes_at_end"] = huge_page_bytes()
    env["wall_s"] = time.perf_counter() - started
    # every process this run started has been waited for by now, so its CPU time is in ours
    env["other_processes_cpu_s"] = (_busy_cpu_s() - busy_before) - (_own_tree_cpu_s() - ours_before)
    results["environment"] = _jsonable(env)
    bench_say(f"run took {env['wall_s']:.0f} s; other processes used {env['other_processes_cpu_s']:.1f} CPU-seconds meanwhile; "
         f"load average at start {env['load_average_at_start'][0]:.2f}")
    summary, ratios, rows = summarize(results)
    table = render_table(rows)
    results["summary"] = summary
    results["ratios"] = ratios
    results["table"] = table
    results["spread"] = _spreads(results)
    _say_checks(results)
    json_path = options.out_dir / whole_run_json(options)
    write_results(results, json_path, options.json_path)
    if options.chart:
        chart_path = json_path.with_suffix(".png")
        write_chart(results, summary, chart_path)
        bench_say(f"wrote {chart_path}")
    return results, table


def whole_run_json(options: BenchOptions) -> str:
    return "bench-quick.json" if options.quick else "bench.json"


def only_run_json(names: list[str]) -> str:
    return f"bench-{'-'.join(names)}.json"


# the parts of the results that are the bench's own records, not a section's measurements
NOT_SECTIONS = frozenset({"environment", "options", "daemons", "shards", "load", "spread", "summary", "ratios", "table"})


def _spreads(results: dict) -> dict:
    """Each section's timed figures: rounds, min, median, max (kvpool.bench.checks.round_spreads)."""
    return {key: round_spreads(value) for key, value in results.items() if key not in NOT_SECTIONS and isinstance(value, dict)}


def _say_checks(results: dict) -> None:
    """At a run's end: one line per contended section, and what has fewer rounds than a measurement needs."""
    for line in contended_lines(results.get("load", {})):
        bench_say(line)
    if results["summary"].get("s3_reference_broken"):
        bench_say("section 3's llama.cpp batched reference was broken (slower for 4 sequences than for 1 alone): its ratios are not verdicts")
    if results["summary"].get("s2_reference_slow"):
        bench_say("section 2's whole model in one llama.cpp context was a slow reference (slower than its 3 shards in one process): route_vs_whole is taken against the shards")
    few = [f"{section}/{path} ({spread['rounds']})" for section, paths in results["spread"].items()
           for path, spread in paths.items() if not spread["enough"]]
    if few:
        bench_say(f"{len(few)} figures have fewer than 3 rounds: {', '.join(few[:12])}{' ...' if len(few) > 12 else ''}")


# ---- sections on daemons of their own: in the whole run, or alone with --only -------------------------


def _overload(shards: list[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions) -> dict:
    return measure_overload([shard.path for shard in shards], tokenizer, socket_dir, steps=options.overload_steps,
                            rounds=options.overload_rounds, say=bench_say)


def _durable(shards: list[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions) -> dict:
    prompt = tokenizer.encode(tokenizer.chat_prompt(PROMPTS[0]))
    return measure_durable(shards[0].path, long_history(tokenizer, prompt, tokens_needed(options)), socket_dir, options, bench_say)


def _move(shards: list[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions) -> dict:
    prompt = tokenizer.encode(tokenizer.chat_prompt(PROMPTS[0]))
    new_shards = cached_shards(options.model, moved_split(shards), progress=bench_say)
    return measure_move(shards, new_shards, long_history(tokenizer, prompt, max(options.move_lengths) + 1), socket_dir, options, bench_say)


def _startup(shards: list[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions) -> dict:
    return measure_startup(shards[len(shards) // 2].path, socket_dir)


def _prefix(shards: list[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions) -> dict:
    return measure_prefix(shards, tokenizer, socket_dir, options, bench_say)


OWN_DAEMON_SECTIONS = {  # --only name: (section, what it measures, how), in the order a whole run takes them
    "warm": ("7", "warm tier, restore vs re-prefill and sessions per GiB", measure_warm),
    "overload": ("8", "overload, 8 sessions on 2 places per daemon", _overload),
    "startup": ("9", "start-up: a first start and a restart with the probe's readings kept, at several --n-ctx", _startup),
    "durable": ("10", "durable sessions: drain and adoption of parked sessions, the first append after a restart vs a re-prefill", _durable),
    "move": ("11", "a re-plan of the 3-shard route onto other split points: Router.replan vs a replay", _move),
    "prefix": ("12", "shared prefixes: a new session's time to first token from a stored system prompt vs without, vs llama.cpp's reuse; memory", _prefix),
}


def _run_own_section(name: str, shards: list[ShardInfo], tokenizer: Tokenizer, socket_dir: pathlib.Path, options: BenchOptions) -> dict:
    section, what, measure = OWN_DAEMON_SECTIONS[name]
    bench_say(f"section {section}: {what}")
    return measure(shards, tokenizer, socket_dir, options)


# --only decode: sections 1, 4 and 2 on a rig of their own (kvpool.bench.rig.Rig with one_session)
ONE_SESSION = "decode"
ONE_SESSION_WHAT = "1, 2, 4"


def _one_session_sections(rig: Rig, meter: LoadMeter) -> dict:
    """Sections 1 and 4 (results key mid_shard) and 2 (route) on `rig`."""
    measured = {}
    bench_say("section 1 and 4: the middle shard, one session")
    with meter.section("mid_shard"):
        measured["mid_shard"] = measure_mid_shard(rig)
    bench_say("section 2: one session through the whole route")
    with meter.section("route"):
        measured["route"] = measure_route(rig, [rig.client(f"chain{index}") for index in range(len(rig.shards))], rig.client("whole"))
    return measured


def _measure_one_session(options: BenchOptions, meter: LoadMeter) -> dict:
    rig = Rig(options, one_session=True)
    try:
        return {"daemons": {"start_s": rig.daemon_start_s, "options": rig.daemon_options}, **_one_session_sections(rig, meter)}
    finally:
        rig.close()


def run_only(options: BenchOptions, names: list[str]) -> tuple[dict, str]:
    """The sections `names` alone: those of OWN_DAEMON_SECTIONS on their own daemons, `decode` (sections 1, 2
    and 4) on a rig of its own; writes <out>/bench-<names>.json."""
    env = environment(options.model)
    shards = shards_in_parts(options.model, 3, progress=bench_say)
    socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    try:
        meter = LoadMeter()
        measured = {}
        with Tokenizer(shards[0].path) as tokenizer:
            for name in names:
                if name == ONE_SESSION:
                    measured.update(_measure_one_session(options, meter))
                    continue
                with meter.section(name):
                    measured[name] = _run_own_section(name, shards, tokenizer, socket_dir, options)
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    env["load_average_at_end"] = os.getloadavg()
    env["huge_page_bytes_at_end"] = huge_page_bytes()
    summary, ratios, rows = summarize({**measured, "options": dataclasses.asdict(options), "load": meter.loads})
    table = render_table(rows)
    results = _jsonable({"environment": env, "options": dataclasses.asdict(options),
                         "shards": {shard.path.name: file_sha256(shard.path) for shard in shards},
                         **measured, "load": meter.loads, "summary": summary, "ratios": ratios, "table": table})
    results["spread"] = _spreads(results)
    _say_checks(results)
    write_results(results, options.out_dir / only_run_json(names), options.json_path)
    return results, table


def _only(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = [ONE_SESSION, *OWN_DAEMON_SECTIONS]
    unknown = sorted(set(names) - set(known))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--only takes a comma-separated list of {', '.join(known)} (got {text!r})")
    return list(dict.fromkeys(names))


def _checked(flag: str, kind: type, what: str, check: Callable) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` (else "takes `what`") that `check` takes (its ValueError, the flag's refusal: exit 2)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {what} (got {text!r})") from None
        try:
            return check(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _whole_number(flag: str, check: Callable[[int], int]) -> Callable[[str], int]:
    return _checked(flag, int, "a whole number", check)


def _seconds(flag: str, check: Callable[[float], float]) -> Callable[[str], float]:
    return _checked(flag, float, "a number of seconds", check)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run (about 6 minutes on 2 idle cores with the bundled model): few rounds and steps, every section")
    parser.add_argument("--model", type=pathlib.Path, help="source GGUF (default: the bundled model)")
    parser.add_argument("--out", type=pathlib.Path, help="output folder (default: <work dir>/bench)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the one-session sections (default 7, quick 3)")
    parser.add_argument("--decode-steps", type=int, help="timed decode steps per round and variant (default 96, quick 12); in section 1 the variants take turns every 3 of them")
    parser.add_argument("--parallel-rounds", type=int, help="interleaved rounds of the four-session section (default 7, quick 3)")
    parser.add_argument("--parallel-steps", type=int, help="decode steps per session per round (default 64, quick 4)")
    parser.add_argument("--repeats", type=int, help="admissions/releases/evictions per size (default 11, quick 3)")
    parser.add_argument("--warm-repeats", type=int, help="rounds of restore against re-prefill per session length (default 3, quick 3)")
    parser.add_argument("--overload-rounds", type=int, help="interleaved rounds of the overload section (default 3, quick 3)")
    parser.add_argument("--overload-steps", type=int, help="decode steps per session in the overload section (default 32, quick 3)")
    parser.add_argument("--durable-sessions", type=int, help="section 10: parked sessions drained and adopted (default 8, quick 4)")
    parser.add_argument("--durable-rounds", type=int, help="section 10: rounds of its three daemon lifetimes (default 2, quick 1)")
    parser.add_argument("--move-rounds", type=int, help="section 11: interleaved rounds of move against replay per length (default 3, quick 3)")
    parser.add_argument("--prefix-rounds", type=int, help="section 12: interleaved rounds of its time-to-first-token variants (default 7, quick 3)")
    alone = parser.add_mutually_exclusive_group()
    alone.add_argument("--only", type=_only, metavar="NAME[,NAME]", help=f"run only these sections, each on daemons of its own: {ONE_SESSION} ({ONE_SESSION_WHAT}: one session, the middle shard and the route), "
                       f"{', '.join(f'{name} ({section})' for name, (section, _what, _how) in OWN_DAEMON_SECTIONS.items())}; writes <out>/bench-<names>.json")
    alone.add_argument("--overload-only", action="store_true", help="run only section 8 (overload) on its own daemons (as --only overload)")
    parser.add_argument("--threads", type=_whole_number("--threads", check_threads), metavar="N", help=f"with --only {ONE_SESSION}: llama threads of every computing context in sections {ONE_SESSION_WHAT}, "
                        "on both sides of each ratio (the daemons' --threads and --threads-per-worker, the in-process references'); default 1, "
                        "kvpool's default --threads-per-worker. llama.cpp may decode one session faster with more (the cores, on an idle machine): "
                        "a run at N shows the daemon's and the route's cost against llama.cpp at that setting")
    parser.add_argument("--keep-warm", type=_seconds("--keep-warm", check_keep_warm), metavar="SECONDS",
                        help=f"sections 1-5: the daemons' --keep-warm (default {BENCH_KEEP_WARM_S:g}: after each session request their CPUs are kept "
                             "busy that long by idle-priority spinners, as on a machine given to the route; 0: off, the CPUs left to halt "
                             "between requests, as kvpool serve's default). Recorded in the results (keep_warm_s)")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    parser.add_argument("--rigs", type=_whole_number("--rigs", check_rigs), default=1, metavar="N", help=f"run it all N times (1-{MAX_RIGS}, default 1), each in a fresh process with "
                        "daemons and references of its own, one after another (results in <out>/rig-K/), and take every headline "
                        "ratio's verdict on its median across them (<out>/bench-...-rigs.json): the same model decodes a few percent "
                        "faster or slower from one process to the next, which one run's rounds cannot average out")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="also write the results (raw figures, summary, and the headline \"ratios\" with their targets; with --rigs, the rigs' combined results) to PATH")


def _sections(args: argparse.Namespace) -> list[str] | None:
    """The sections run alone (--only, --overload-only), or None: a whole run."""
    return ["overload"] if args.overload_only else args.only


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    only = _sections(args)
    if args.threads is not None and only != [ONE_SESSION]:
        raise ValueError(f"--threads applies to sections {ONE_SESSION_WHAT} alone: give it with --only {ONE_SESSION}")
    if args.keep_warm is not None and only is not None and ONE_SESSION not in only:
        raise ValueError(f"--keep-warm applies to sections 1-5's daemons: give it with a whole run or --only {ONE_SESSION}")
    model = (args.model or bundled_model_path()).resolve()
    out_dir = (args.out or work_dir() / "bench").resolve()
    base = BenchOptions.quick_run(out_dir, model) if args.quick else BenchOptions(out_dir=out_dir, model=model)
    overrides = {
        field: value
        for field, value in (("rounds", args.rounds), ("decode_steps", args.decode_steps), ("parallel_rounds", args.parallel_rounds),
                             ("parallel_steps", args.parallel_steps), ("repeats", args.repeats),
                             ("warm_repeats", args.warm_repeats), ("overload_rounds", args.overload_rounds), ("overload_steps", args.overload_steps),
                             ("durable_sessions", args.durable_sessions), ("durable_rounds", args.durable_rounds),
                             ("move_rounds", args.move_rounds), ("prefix_rounds", args.prefix_rounds), ("threads", args.threads),
                             ("keep_warm_s", args.keep_warm))
        if value is not None
    }
    json_path = args.json.resolve() if args.json is not None else None
    return dataclasses.replace(base, chart=not args.no_chart, json_path=json_path, **overrides)


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    only = _sections(args)
    if args.rigs > 1:
        runner, json_name = (functools.partial(run_only, names=only), only_run_json(only)) if only else (run_bench, whole_run_json(options))
        _, table = run_rigs(runner, options, args.rigs, json_name)
    else:
        _, table = run_only(options, only) if only else run_bench(options)
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool bench", description=sys.modules[__package__].__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))

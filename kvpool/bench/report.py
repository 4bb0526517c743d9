"""The report of one run: `summarize` joins every section's medians, headline ratios and table rows, in
section order. Each section's report lives beside its measurement (kvpool.bench.one_session_report,
parallel_report, admission_report, prefix_report; warm, overload, startup, durable and move summarize their
own); the chart is kvpool.bench.chart. A section that was contended (kvpool.bench.checks.is_contended, from
results["load"]) keeps its figures, but its ratios get the withheld verdict and its table rows say why."""

from __future__ import annotations

import dataclasses

from kvpool.bench.admission_report import summarize_admission, summarize_memory
from kvpool.bench.checks import BROKEN, CONTENDED, is_contended, with_verdict, withhold
from kvpool.bench.durable import summarize_durable
from kvpool.bench.move import summarize_move
from kvpool.bench.one_session_report import summarize_mid_shard, summarize_prefill, summarize_route
from kvpool.bench.overload import summarize_overload
from kvpool.bench.parallel_report import summarize_parallel
from kvpool.bench.prefix_report import summarize_prefix
from kvpool.bench.startup import summarize_startup
from kvpool.bench.table import Row
from kvpool.bench.warm import summarize_warm

SECTIONS = (summarize_mid_shard, summarize_route, summarize_parallel, summarize_prefill, summarize_admission, summarize_memory)
# the results key (and results["load"] key) each of SECTIONS summarizes
SECTION_KEYS = ("mid_shard", "route", "parallel", "mid_shard", "admission", "memory")
# sections with their own daemons, summarized from their own part of the results when it is there (`--only`)
OWN_SECTIONS = {"warm": summarize_warm, "overload": summarize_overload, "startup": summarize_startup, "durable": summarize_durable,
                "move": summarize_move, "prefix": summarize_prefix}


def withhold_contended(load: dict | None, ratios: dict[str, dict], rows: list[Row]) -> tuple[dict[str, dict], list[Row]]:
    """One section's ratios and rows as reported when its `load` says it was contended: every ratio keeps its
    value with the verdict CONTENDED, and every row with a ratio or a target says so in its target cell."""
    if load is None or not is_contended(load):
        return ratios, rows
    why = f"{CONTENDED} (other processes used {load['other_cores']:.2f} cores)"
    return ({name: withhold(ratio, CONTENDED) for name, ratio in ratios.items()},
            [dataclasses.replace(row, target=f"{row.target}; {why}" if row.target.startswith(BROKEN) else why) if row.ratio or row.target else row
             for row in rows])


def summarize(results: dict) -> tuple[dict, dict, list[Row]]:
    """Medians and ratios from the raw measurements (summary); the headline ratios by name, each with its
    target and its verdict (JSON "ratios"); the table rows."""
    summary: dict[str, float | int | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []
    loads = results.get("load", {})
    parts = [(key, section(results)) for key, section in zip(SECTION_KEYS, SECTIONS) if key in results]
    parts += [(key, summarizer(results[key])) for key, summarizer in OWN_SECTIONS.items() if key in results]
    for key, (section_summary, section_ratios, section_rows) in parts:
        section_ratios, section_rows = withhold_contended(loads.get(key), section_ratios, section_rows)
        summary.update(section_summary)
        ratios.update({name: with_verdict(ratio) for name, ratio in section_ratios.items()})
        rows += section_rows
    return summary, ratios, rows

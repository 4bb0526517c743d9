"""The report of one run: `summarize` joins every section's medians, headline ratios and table rows, in
section order. Each section's report lives beside its measurement (kvpool.bench.one_session_report,
parallel_report, admission_report, prefix_report; warm, overload, startup, durable and move summarize their
own); the chart is kvpool.bench.chart."""

from __future__ import annotations

from kvpool.bench.admission_report import summarize_admission, summarize_memory
from kvpool.bench.durable import summarize_durable
from kvpool.bench.move import summarize_move
from kvpool.bench.one_session_report import summarize_mid_shard, summarize_prefill, summarize_route
from kvpool.bench.overload import summarize_overload
from kvpool.bench.parallel_report import summarize_parallel
from kvpool.bench.prefix_report import summarize_prefix
from kvpool.bench.table import Row
from kvpool.bench.startup import summarize_startup
from kvpool.bench.warm import summarize_warm

SECTIONS = (summarize_mid_shard, summarize_route, summarize_parallel, summarize_prefill, summarize_admission, summarize_memory)
# sections with their own daemons, summarized from their own part of the results when it is there (`--only`)
OWN_SECTIONS = {"warm": summarize_warm, "overload": summarize_overload, "startup": summarize_startup, "durable": summarize_durable,
                "move": summarize_move, "prefix": summarize_prefix}


def summarize(results: dict) -> tuple[dict, dict, list[Row]]:
    """Medians and ratios from the raw measurements (summary); the headline ratios by name, each with its
    target (JSON "ratios"); the table rows."""
    summary: dict[str, float | int | bool] = {}
    ratios: dict[str, dict] = {}
    rows: list[Row] = []
    parts = [section(results) for section in SECTIONS] if "mid_shard" in results else []
    parts += [summarizer(results[key]) for key, summarizer in OWN_SECTIONS.items() if key in results]
    for section_summary, section_ratios, section_rows in parts:
        summary.update(section_summary)
        ratios.update(section_ratios)
        rows += section_rows
    return summary, ratios, rows

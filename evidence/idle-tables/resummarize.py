"""The headline ratios and section 2's first table row that this checkout's report (kvpool.bench.report.summarize)
gives for a bench JSON's raw measurements, e.g. a table recorded before a check was added.

    PYTHONPATH=. python evidence/idle-tables/resummarize.py BENCH.json [RATIO ...]
"""
import json
import sys

from kvpool.bench.report import summarize

results = json.load(open(sys.argv[1]))
summary, ratios, rows = summarize(results)
for name in sys.argv[2:] or ratios:
    ratio = ratios[name]
    print(f"{name}: {ratio['value']:.3f} (target {ratio['target']}): {ratio['verdict']}")
row = next(row for row in rows if row.section == "2")
print(f"| {row.section} | {row.what} | {row.kvpool} | {row.reference} | {row.ratio} | {row.target} |")

"""Stop 55: the four-session pairs (four-{new,old}-{1..8}.txt) as a table: each run's median tok/s, new / old per pair,
the mean of the pairs' ratios and the medians of the runs. Usage: pairs.py (in this folder)"""
import re, statistics
ratios, runs = [], {"old": [], "new": []}
for i in range(1, 9):
    value = {side: float(re.search(r"median ([0-9.]+) tok/s", open(f"four-{side}-{i}.txt").read().splitlines()[-1]).group(1)) for side in ("old", "new")}
    for side in value:
        runs[side].append(value[side])
    ratios.append(value["new"] / value["old"])
    print(f"| {i} | {'new' if i % 2 else 'old'} | {value['old']:.2f} | {value['new']:.2f} | {ratios[-1]:.3f} |")
print(f"new higher in {sum(r > 1 for r in ratios)} of {len(ratios)}; mean of the ratios {statistics.mean(ratios):.3f}; "
      f"medians of the runs: old {statistics.median(runs['old']):.2f}, new {statistics.median(runs['new']):.2f} tok/s")

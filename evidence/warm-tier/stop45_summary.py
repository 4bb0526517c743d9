"""Section 7's 512-token figures from `kvpool bench --only warm` JSON files (min/median/max ms of the park's
answer, the restoring decode, the hot decode; the re-prefill's median; the ratio of record as the bench takes it: the
re-prefill's median over the median of each cycle's park + restoring decode)."""
import json
import statistics
import sys

for path in sys.argv[1:]:
    lengths = json.load(open(path))["warm"]["lengths"]["512"]
    spread = lambda key: "%.2f/%.2f/%.2f" % tuple(value * 1e3 for value in (min(lengths[key]), statistics.median(lengths[key]), max(lengths[key])))
    med = lambda key: statistics.median(lengths[key]) * 1e3
    ratio = med("reprefill_s") / (statistics.median([a + b for a, b in zip(lengths["park_s"], lengths["restore_s"])]) * 1e3)
    print(f"{path.rsplit('/', 1)[-1]:45s} park {spread('park_s')}  restoring decode {spread('restore_s')}  hot {spread('hot_decode_s')}  re-prefill {med('reprefill_s'):.0f}  {ratio:.1f}x")

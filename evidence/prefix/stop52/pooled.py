"""Section 12's rounds of the alternated runs pooled per side: python pooled.py DIR (bench-ab/ with bundled-{new,old}-N.json)."""
import json, pathlib, statistics, sys
directory = pathlib.Path(sys.argv[1])
for side in ("new", "old"):
    cached, llama, ratios, admits, first_less_hot = [], [], [], [], []
    for path in sorted(directory.glob(f"bundled-{side}-*.json")):
        prefix = json.loads(path.read_text())["prefix"]
        runs = prefix["runs"]
        c, l = [one["s"] for one in runs["cached"]], [one["s"] for one in runs["llama.cpp"]]
        cached += c
        llama += l
        ratios.append(statistics.median(l) / statistics.median(c))
        admits += [one["admit_s"] for one in runs["components"]]
        first_less_hot += [sum(runs["components"][i]["first_append_s"]) - sum(runs["components"][i]["hot_append_s"]) for i in range(len(runs["components"]))]
    ms = lambda values: f"{statistics.median(values) * 1e3:.1f} ms ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"
    print(f"{side}: cached time to first token {ms(cached)} over {len(cached)} rounds; llama.cpp kept context {ms(llama)}; "
          f"per-run ratios {' '.join(f'{r:.2f}' for r in ratios)}; admission {ms(admits)}; component first append less hot, summed {ms(first_less_hot)}")

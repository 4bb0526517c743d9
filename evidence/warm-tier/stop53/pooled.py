"""Section 12's cached time to first token and llama.cpp's kept-context reuse, every round of the A/B runs pooled by
side; and each run's component session's first append less the same append hot, summed over the daemons.
Usage: pooled.py DIR (with bundled-{new,old}-{1,2}/bench-prefix.json)"""
import json, statistics, sys, pathlib
root = pathlib.Path(sys.argv[1])
for side in ("new", "old"):
    cached, llama = [], []
    for run in sorted(root.glob(f"bundled-{side}-*/bench-prefix.json")):
        d = json.load(open(run))
        runs = d["prefix"]["runs"]
        cached += [r["s"] for r in runs["cached"]]
        llama += [r["s"] for r in runs["llama.cpp"]]
        print(f"{run.parent.name}: cached median {statistics.median(r['s'] for r in runs['cached']) * 1e3:.1f} ms, llama.cpp {statistics.median(r['s'] for r in runs['llama.cpp']) * 1e3:.1f} ms, "
              f"ratio {d['ratios']['prefix_vs_llama_cpp_ttft']['value']:.3f}")
    print(f"{side}: {len(cached)} rounds pooled: cached median {statistics.median(cached) * 1e3:.1f} ms ({min(cached) * 1e3:.1f}-{max(cached) * 1e3:.1f}), "
          f"llama.cpp kept context {statistics.median(llama) * 1e3:.1f} ms ({min(llama) * 1e3:.1f}-{max(llama) * 1e3:.1f}), ratio of the pooled medians {statistics.median(llama) / statistics.median(cached):.3f}")

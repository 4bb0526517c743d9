"""Summary of kw_alternate.sh's runs: per --keep-warm setting, each run's headline ratios and ms a token, and the
median (min-max) across runs. Usage: python kw_summary.py OUT"""
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
by = {}
for path in sorted(out.glob("kw*-*/bench-decode.json"), key=lambda p: (p.parent.name.split("-")[1].zfill(3), p.parent.name)):
    r = json.loads(path.read_text()); s = r["summary"]
    kw = r["options"]["keep_warm_s"]
    row = {"daemon_vs_inprocess": r["ratios"]["daemon_vs_inprocess"]["value"], "route_vs_whole": r["ratios"]["route_vs_whole"]["value"],
           "s1 daemon ms": s["s1_daemon_decode_s"] * 1e3, "s1 runtime ms": s["s1_runtime_decode_s"] * 1e3,
           "s2 whole ms": s["s2_whole_decode_s"] * 1e3, "s2 route sampled ms": s["s2_sampled_chain_decode_s"] * 1e3,
           "s2 whole via 1 daemon ms": s["s2_daemon_whole_decode_s"] * 1e3,
           "other cores max": max(v["other_cores"] for v in r["load"].values()), "contended": any(v["contended"] for v in r["load"].values())}
    by.setdefault(kw, []).append(row)
    print(f"{path.parent.name}: keep_warm {kw:g} " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
for kw, rows in sorted(by.items()):
    print(f"--keep-warm {kw:g}, {len(rows)} runs: " + ", ".join(
        f"{k} {statistics.median(x[k] for x in rows):.3f} ({min(x[k] for x in rows):.3f}-{max(x[k] for x in rows):.3f})"
        for k in ("daemon_vs_inprocess", "route_vs_whole", "s2 whole ms", "s2 route sampled ms", "s1 daemon ms", "s1 runtime ms")))

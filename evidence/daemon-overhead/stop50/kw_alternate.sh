#!/bin/bash
# usage: kw_alternate.sh OUT PAIRS -- `kvpool bench --only decode` at ~1B, the daemons at --keep-warm 0 and 1 taking
# turns (0 first), PAIRS times: each run a fresh bench process with daemons and references of its own (as a rig)
cd /work/main
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for i in $(seq 1 $2); do
  for kw in 0 1; do
    out=$1/kw$kw-$i
    echo "== run $i --keep-warm $kw $(date -u +%H:%M:%S)"
    flock /tmp/kvpool-cpu.lock .venv/bin/kvpool bench --only decode --model $M --no-chart --keep-warm $kw --out $out > $out.log 2>&1
    echo "rc $? $(date -u +%H:%M:%S)"
    .venv/bin/python - $out/bench-decode.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: round(v["value"], 4) for k, v in r["ratios"].items() if k in ("daemon_vs_inprocess", "route_vs_whole")},
      "other cores", {k: round(v.get("other_cores", float("nan")), 3) if isinstance(v, dict) else v for k, v in r["load"].items()})
PY
  done
done

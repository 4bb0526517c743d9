#!/bin/bash
# usage: evidence/daemon-overhead/hop_ab.sh BASE N -- alternates BASE (old) and HEAD (new) N times: the hop probe, 150 route steps each,
# with the instrumentation (hop_timing_instrument.py) applied for the run only
cd "$(dirname "$0")/../.."
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
git diff --quiet HEAD || { echo "tree not clean"; exit 1; }
for i in $(seq 1 $2); do
  for v in old new; do
    if [ $v = old ]; then git checkout -q $1 -- kvpool workers; else git checkout -q HEAD -- kvpool workers; fi
    python3 evidence/daemon-overhead/hop_timing_instrument.py
    rm -f /tmp/fine_times.*
    echo "== $v ($( [ $v = old ] && echo $1 || git rev-parse --short HEAD ))"
    flock /tmp/kvpool-cpu.lock .venv/bin/python evidence/daemon-overhead/hop_split_probe.py $M 150 2>&1 | grep -v "^kvpool" > /tmp/hop-ab-$v-$i.txt
    grep "total\|outside" /tmp/hop-ab-$v-$i.txt | tr -s ' ' | tr '\n' ' '; echo
  done
done
git checkout -q HEAD -- kvpool workers
git status --short

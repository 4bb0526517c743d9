#!/bin/bash
# Stop 56's driver, started while README's test command ran in /tmp/ciY (each step waits for the lock it held):
# README's demo command in that clone, then stop 56's probes (evidence/daemon-overhead/stop56/series.sh), then the ~1B quick table.
date -u +%H:%M:%S
(cd /tmp/ciY && (time flock /tmp/kvpool-cpu.lock bash scripts/demo.sh) > /tmp/p56/demo.txt 2>&1; echo "demo rc $?" >> /tmp/p56/demo.txt)
date -u +%H:%M:%S
cd /work/main && evidence/daemon-overhead/stop56/series.sh
date -u +%H:%M:%S
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
sha256sum "$M"
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --model "$M" --out /tmp/p56/q1b) > /tmp/p56/q1b.log 2>&1
date -u +%H:%M:%S

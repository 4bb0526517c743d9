#!/bin/bash
# the forward probe 4 times and the idle probe twice at ~1B, one after another, each alone under the lock
M=/work/main/.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
cd /work/main
for i in 1 2 3 4; do
  date -u +%H:%M:%S
  flock /tmp/kvpool-cpu.lock .venv/bin/python /tmp/p53/forward_probe.py $M 60 > /tmp/p53/out/forward-$i.txt 2>&1
done
for i in 1 2; do
  date -u +%H:%M:%S
  flock /tmp/kvpool-cpu.lock .venv/bin/python /tmp/p53/idle_probe.py $M 40 > /tmp/p53/out/idle-$i.txt 2>&1
done
date -u +%H:%M:%S

#!/bin/bash
# old (/work/main at 10c8bd9) and new (/tmp/dev54: the compute locks' line and bell) in alternated pairs, each alone under the lock
M=/work/main/.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for i in 1 2 3; do
  for side in old new; do
    dir=/work/main; [ $side = new ] && dir=/tmp/dev54
    date -u +%H:%M:%S
    (cd $dir && flock /tmp/kvpool-cpu.lock /work/main/.venv/bin/python /tmp/p54/four_probe.py $M 4 24 > /tmp/p54/four-$side-$i.txt 2>&1)
  done
done
date -u +%H:%M:%S

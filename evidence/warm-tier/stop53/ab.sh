#!/bin/bash
# new (/tmp/dev53: released contexts kept as spares) and old (/work/main, 7c1acb2) taking turns, each alone under flock:
# section 12 alone (bundled, full rounds) twice each, then the admission probe at ~1B twice each
set -u
OUT=/tmp/p53/ab
M=/work/main/.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for i in 1 2; do
  for side in new old; do
    root=/work/main; [ $side = new ] && root=/tmp/dev53
    date -u +"%H:%M:%S prefix $side $i"
    (cd $root && (time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --only prefix --no-chart --out $OUT/bundled-$side-$i) > $OUT/bundled-$side-$i.log 2>&1)
  done
done
for i in 1 2; do
  for side in new old; do
    root=/work/main; [ $side = new ] && root=/tmp/dev53
    date -u +"%H:%M:%S admit $side $i"
    (cd $root && ROOT=$root flock /tmp/kvpool-cpu.lock .venv/bin/python /tmp/p53/admit_probe.py $M 2048 10 > $OUT/admit-$side-$i.txt 2>&1)
  done
done
date -u +"%H:%M:%S done"

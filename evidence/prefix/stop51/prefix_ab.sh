#!/bin/bash
# section 12 alone, new (e7d013b, /work/main) and old (f5f1921, /tmp/old51) taking turns, each alone under flock
set -u
OUT=/tmp/p51/prefix-ab
mkdir -p $OUT
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for i in 1 2; do
  for side in new old; do
    root=/work/main; [ $side = old ] && root=/tmp/old51
    (cd $root && (time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --only prefix --out $OUT/bundled-$side-$i) > $OUT/bundled-$side-$i.log 2>&1)
  done
done
for side in new old; do
  root=/work/main; [ $side = old ] && root=/tmp/old51
  (cd $root && (time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --only prefix --model $M --out $OUT/1b-$side) > $OUT/1b-$side.log 2>&1)
done

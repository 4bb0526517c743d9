#!/bin/bash
# section 12 alone at ~1B (quick), new (e7d013b, /work/main) then old (f5f1921, /tmp/old51), each alone under flock
set -u
OUT=/tmp/p51/prefix-ab
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for side in new old; do
  root=/work/main; [ $side = old ] && root=/tmp/old51
  (cd $root && (time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --only prefix --prefix-rounds 5 --model $M --out $OUT/1b-$side-2) > $OUT/1b-$side-2.log 2>&1)
done

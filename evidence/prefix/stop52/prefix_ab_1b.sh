#!/bin/bash
# section 12 alone at ~1B (quick, 5 rounds), new (688dcbd, /work/main) and old (7aeecd1, /tmp/old52) taking turns, each alone under flock
set -u
RUN=${RUN:-}
OUT=/tmp/p52/prefix-ab-1b
mkdir -p $OUT
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for side in ${SIDES:-new old}; do
  root=/work/main; [ $side = old ] && root=/tmp/old52
  (cd $root && (time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --only prefix --prefix-rounds 5 --model $M --out $OUT/1b-$side$RUN) > $OUT/1b-$side$RUN.log 2>&1)
done

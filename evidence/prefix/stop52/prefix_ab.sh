#!/bin/bash
# section 12 alone (bundled, full rounds), new (/tmp/dev52: the capture after the reply) and old (7aeecd1, /work/main) taking turns, each alone under flock
set -u
OUT=/tmp/p52/prefix-ab
mkdir -p $OUT
for i in ${PAIRS:-1 2}; do
  for side in new old; do
    root=/work/main; [ $side = new ] && root=/tmp/dev52
    (cd $root && (time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --only prefix --out $OUT/bundled-$side-$i) > $OUT/bundled-$side-$i.log 2>&1)
  done
done

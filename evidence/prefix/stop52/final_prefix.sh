#!/bin/bash
# section 12 alone (bundled, full rounds) on the final code (688dcbd, /work/main), twice, each alone under flock
set -u
OUT=/tmp/p52/prefix-final
mkdir -p $OUT
for i in 1 2; do
  (cd /work/main && (time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --only prefix --out $OUT/bundled-final-$i) > $OUT/bundled-final-$i.log 2>&1)
done

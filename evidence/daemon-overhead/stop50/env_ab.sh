#!/bin/bash
# alternates the hop probe with and without an environment for every process (client, supervisors, workers)
cd /work/main
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
python3 evidence/daemon-overhead/hop_timing_instrument.py || exit 1
for i in $(seq 1 $1); do
  for v in plain env; do
    rm -f /tmp/fine_times.*
    if [ $v = env ]; then E="PYTHONMALLOC=malloc GLIBC_TUNABLES=glibc.malloc.hugetlb=1"; else E=""; fi
    echo "== $v $E"
    flock /tmp/kvpool-cpu.lock env $E .venv/bin/python evidence/daemon-overhead/hop_split_probe.py $M 150 2>&1 | grep -v "^kvpool" > /tmp/p50/hop-$v-$i.txt
    grep "total\|outside" /tmp/p50/hop-$v-$i.txt | tr -s ' ' | tr '\n' ' '; echo
  done
done
git checkout -q HEAD -- kvpool workers
git status --short

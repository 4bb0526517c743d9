#!/bin/bash
# after README's test command on a fresh clone of 3c67778 (/tmp/ci55, the suite holding the lock): the compute
# bound's micro-benchmark series (evidence/daemon-overhead/stop55), README's demo command in that clone, the bundled
# model's full table from it, the ~1B model generated there and its quick table; each alone under the lock
while ! grep -q "^real" /tmp/ci55/LOG; do sleep 20; done
date -u +%H:%M:%S
/tmp/dev55/evidence/daemon-overhead/stop55/lock_series.sh > /tmp/dev55/evidence/daemon-overhead/stop55/lock_series.txt 2>&1
cd /tmp/ci55 && (time flock /tmp/kvpool-cpu.lock bash scripts/demo.sh) > /tmp/ci55/DEMO 2>&1; echo "demo rc $?" >> /tmp/ci55/DEMO
date -u +%H:%M:%S
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --out /tmp/p55/tables/full) > /tmp/p55/tables/full.log 2>&1
date -u +%H:%M:%S
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool.tools.synthetic --llama-1b --threads 2) > /tmp/p55/tables/synthetic.log 2>&1
M=$(ls /tmp/ci55/.kvpool/models/llama-1b-*/llama-1b.Q4_K_M.gguf | head -1)
echo "M=$M"; sha256sum "$M"
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --model "$M" --out /tmp/p55/tables/q1b) > /tmp/p55/tables/q1b.log 2>&1
date -u +%H:%M:%S

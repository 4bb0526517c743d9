#!/bin/bash
# the rest of tables-stop55.sh (its driver ended after the bundled table): the ~1B model and its quick table, then the lock series
cd /tmp/ci55
date -u +%H:%M:%S
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool.tools.synthetic --llama-1b --threads 2) > /tmp/p55/tables/synthetic.log 2>&1
M=$(ls /tmp/ci55/.kvpool/models/llama-1b-*/llama-1b.Q4_K_M.gguf | head -1)
echo "M=$M"; sha256sum "$M"
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --model "$M" --out /tmp/p55/tables/q1b) > /tmp/p55/tables/q1b.log 2>&1
date -u +%H:%M:%S
/tmp/dev55/evidence/daemon-overhead/stop55/lock_series.sh > /tmp/dev55/evidence/daemon-overhead/stop55/lock_series.txt 2>&1
date -u +%H:%M:%S

#!/bin/bash
# after README's test command (the suite, holding the lock): README's demo command in that clone, then the two tables
# of record from /tmp/dev54 (the same code), each alone under the lock
M=/work/main/.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
cd /tmp/ci54 && (time flock /tmp/kvpool-cpu.lock bash scripts/demo.sh) > /tmp/ci54/DEMO 2>&1; echo "demo rc $?" >> /tmp/ci54/DEMO
cd /tmp/dev54
date -u +%H:%M:%S
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --out /tmp/p54/tables/full) > /tmp/p54/tables/full.log 2>&1
date -u +%H:%M:%S
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --model $M --out /tmp/p54/tables/q1b) > /tmp/p54/tables/q1b.log 2>&1
date -u +%H:%M:%S

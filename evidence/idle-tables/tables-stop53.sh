#!/bin/bash
# the two tables of record on eefd899 (code) from /tmp/dev53, each alone under flock, one after the other
cd /tmp/dev53
date -u +"%H:%M:%S full"
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --out /tmp/p53/tables/full) > /tmp/p53/tables/full.log 2>&1
date -u +"%H:%M:%S q1b"
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --quick --model .kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf --out /tmp/p53/tables/q1b) > /tmp/p53/tables/q1b.log 2>&1
date -u +"%H:%M:%S done"

#!/bin/bash
# after README's test command on a fresh clone of 97ce075 (the suite, holding the lock): README's demo command in that
# clone, then the bundled model's full table from it, each alone under the lock
cd /tmp/ci54b && (time flock /tmp/kvpool-cpu.lock bash scripts/demo.sh) > /tmp/ci54b/DEMO 2>&1; echo "demo rc $?" >> /tmp/ci54b/DEMO
date -u +%H:%M:%S
(time flock /tmp/kvpool-cpu.lock .venv/bin/python -m kvpool bench --out /tmp/p54/tables2/full) > /tmp/p54/tables2/full.log 2>&1
date -u +%H:%M:%S

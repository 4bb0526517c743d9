#!/bin/bash
# the compute bound alone (lock_micro.py), old and new alternated, each alone under the lock
P=$(cd "$(dirname "$0")" && pwd)
for i in 1 2 3; do
  for dir in /tmp/dev55 /tmp/old55; do
    (cd $dir && flock /tmp/kvpool-cpu.lock /work/main/.venv/bin/python $P/lock_micro.py 3 0.3 5)
  done
done

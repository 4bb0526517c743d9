#!/bin/bash
# the stop-51 prefix probe (8 rounds, the three supervisors under cProfile), on 688dcbd (/tmp/dev52: the memfd
# admission) and on 688dcbd with adc02b0 reverted (/tmp/rev52), taking turns, each alone under flock
set -u
for i in 1 2; do
  for side in new rev; do
    root=/tmp/dev52; [ $side = rev ] && root=/tmp/rev52
    rm -rf /tmp/p52/prof-$side-$i
    (cd $root && OUT=/tmp/p52/prof-$side-$i PROFILE=1 flock /tmp/kvpool-cpu.lock .venv/bin/python /work/main/evidence/prefix/stop51/prefix_probe.py 8 $root 2>&1 | grep -v "^kvpool") > /tmp/p52/probe-prof-$side-$i.txt 2>&1
  done
done

#!/bin/bash
# 6 rounds of three conditions, one after another: no spinners / two external per-CPU SCHED_IDLE spinners / --keep-warm 1
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for k in 1 2 3 4 5 6; do
  .venv/bin/python /tmp/p49/kw_route.py $M 30 --keep-warm 0 2>&1 | grep -v '^kvpool' | sed "s/^/$k off: /"
  python3 /tmp/p49/idle_spinner.py 0 & A=$!; python3 /tmp/p49/idle_spinner.py 1 & B=$!
  .venv/bin/python /tmp/p49/kw_route.py $M 30 --keep-warm 0 2>&1 | grep -v '^kvpool' | sed "s/^/$k external: /"
  kill $A $B; wait $A $B 2>/dev/null
  .venv/bin/python /tmp/p49/kw_route.py $M 30 --keep-warm 1 2>&1 | grep -v '^kvpool' | sed "s/^/$k keep-warm: /"
done

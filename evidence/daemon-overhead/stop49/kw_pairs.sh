#!/bin/bash
# N pairs, one after another: --keep-warm 0 then --keep-warm 1 (kw_route.py, 30 rounds each)
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
for k in $(seq 1 $1); do
  .venv/bin/python evidence/daemon-overhead/stop49/kw_route.py $M 30 --keep-warm 0 2>&1 | grep -v '^kvpool' | sed "s/^/$k off: /"
  .venv/bin/python evidence/daemon-overhead/stop49/kw_route.py $M 30 --keep-warm 1 2>&1 | grep -v '^kvpool' | sed "s/^/$k keep-warm: /"
done

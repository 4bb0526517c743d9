#!/bin/bash
# Stop 56's probes after the suite, one after the other, alone under the lock (run from the checkout's root):
# the direct path's breakdown at ~1B, the hop probe again, the send micro-benchmark, the client's side of a route.
set -u
D=evidence/daemon-overhead/stop56
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
flock /tmp/kvpool-cpu.lock bash -c "
  PYTHONPATH=. .venv/bin/python scripts/probe_direct_path.py --part breakdown --blocks 10 --steps 50 --model $M > $D/breakdown-1b.txt 2>&1
  .venv/bin/python $D/hop_probe.py $M 60 20 > $D/hop-2.txt 2>&1
  for i in 1 2; do for w in select epoll recv; do python3 $D/send_micro.py \$w 200; done; done > $D/send_micro.txt 2>&1
  .venv/bin/python $D/client_prof.py > $D/client_prof.txt 2>&1
"

#!/bin/bash
# the hop probe, with perf sampling the six worker processes (the probe's three, kvpool's three) for 90 s once all are up
cd /work/main
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
.venv/bin/python evidence/daemon-overhead/stop56/hop_probe.py $M 60 > /tmp/perf56/probe.txt 2>&1 &
probe=$!
while ! grep -q "^pids:" /tmp/perf56/probe.txt 2>/dev/null; do sleep 1; done
sleep 5
pids=$(python3 -c "
import ast,re
line=[l for l in open('/tmp/perf56/probe.txt') if l.startswith('pids:')][0]
g=ast.literal_eval(line[5:].strip())
print(','.join(str(p) for p in g['probe workers']+g['daemon workers']))")
echo "pids $pids"
perf record -e cpu-clock -F 1999 -g -p $pids -o /tmp/perf56/perf.data -- sleep 90 2>&1 | tail -2
wait $probe

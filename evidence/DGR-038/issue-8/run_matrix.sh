#!/usr/bin/env bash
# Every `kvpool stress` scenario of issue 8 (old and new) on seeds 0, 1 and 2, one run at a time.
# Each run's command, everything it printed (stderr and stdout) and its exit code go to <name>.txt, its
# raw figures to <name>.json. Run from the repository root: bash evidence/DGR-038/issue-8/run_matrix.sh
set -u
out=${OUT:-evidence/DGR-038/issue-8}
environment() {
  echo "\$ date -u"; date -u
  echo "\$ git rev-parse HEAD"; git rev-parse HEAD
  echo "\$ git status --short -- kvpool workers scripts pyproject.toml"; git status --short -- kvpool workers scripts pyproject.toml
  echo "\$ git diff HEAD -- kvpool workers scripts pyproject.toml | sha256sum"; git diff HEAD -- kvpool workers scripts pyproject.toml | sha256sum
  echo "\$ cat kvpool/*.py kvpool/*/*.py workers/*.py | sha256sum"; cat kvpool/*.py kvpool/*/*.py workers/*.py | sha256sum
  echo "\$ uptime"; uptime
}
{
  echo "\$ lscpu | head -20"; lscpu | head -20
  echo "\$ nproc"; nproc
  echo "\$ .venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)'"; .venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)'
  echo "(before the first run)"; environment
} > "$out/environment.txt" 2>&1
scenarios=("default:" "budget-for-2:--budget-for 2" "ttl-1:--ttl 1" "kill-worker:--kill-worker"
           "kill-supervisor:--kill-supervisor" "stall-worker:--stall-worker" "slow-reader:--slow-reader")
for seed in ${SEEDS:-0 1 2}; do
  for entry in "${scenarios[@]}"; do
    name="stress-${entry%%:*}-seed$seed"
    flags="${entry#*:}"
    command=".venv/bin/python scripts/stress_four_sessions.py $flags --seed $seed --json $out/$name.json"
    command="${command//  / }"
    { echo "\$ $command"; $command 2>&1; echo "(exit code $?)"; } > "$out/$name.txt"
    echo "$name: $(grep "^RESULT" "$out/$name.txt") $(tail -1 "$out/$name.txt")"
  done
done
{ echo "(after the last run)"; environment; } >> "$out/environment.txt" 2>&1

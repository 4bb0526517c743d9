#!/usr/bin/env bash
# The main job on the embedded default: install, cut the bundled model into 3 shards, generate through them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kvpool generate "$@"

#!/usr/bin/env bash
# The main job on the embedded default: install, cut the bundled model into 3 shards, serve each with a
# kvpool daemon, generate text through the three daemons.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kvpool demo "$@"

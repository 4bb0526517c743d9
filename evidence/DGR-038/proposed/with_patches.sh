#!/usr/bin/env bash
# Run a Python command against a throwaway copy of kvpool/, workers/ and tests/ with proposed patches
# applied; the checkout itself is never changed. Run from the repository root:
#   bash evidence/DGR-038/proposed/with_patches.sh in_transit.patch [more.patch ...] -- -m kvpool stress --budget-for 2
# Arguments after -- go to the repository's .venv/bin/python, run inside the copy (so `-m kvpool`, the
# daemons it starts and their workers all import the patched code); shards are shared with the checkout.
set -euo pipefail
repo="$(pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
copy="$(mktemp -d /tmp/kvpool-patched-XXXXXX)"
trap 'rm -rf "$copy"' EXIT
cp -r "$repo/kvpool" "$repo/workers" "$repo/tests" "$repo/pyproject.toml" "$copy/"
patches=()
while [[ $# -gt 0 && "$1" != "--" ]]; do patches+=("$1"); shift; done
shift
for patch in "${patches[@]}"; do
    (cd "$copy" && patch -s -p1 < "$here/$patch")
    echo "applied $patch" >&2
done
cd "$copy"
export PYTHONPATH="$copy" KVPOOL_WORK_DIR="$repo/.kvpool"
"$repo/.venv/bin/python" -c "import kvpool, sys; assert kvpool.__file__.startswith(sys.argv[1]), kvpool.__file__" "$copy"
"$repo/.venv/bin/python" "$@"

#!/usr/bin/env bash
# Issue 18, item 5, on the final tree: build a wheel from a clean copy of HEAD, install it into a fresh venv
# (dependencies through a .pth naming the dev venv's site-packages), and run `kvpool --help` and the demo
# with no compiler on PATH and a home that cannot be written. Usage: bash evidence/layout/wheel_demo.sh
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dev_python="$repo/.venv/bin/python"
work="$(mktemp -d /tmp/kvpool-wheel-XXXXXX)"
cd "$work"
run() { echo "\$ $*"; "$@"; echo "[exit $?]"; }
git -C "$repo" archive HEAD | (mkdir src && tar -x -C src)
run "$dev_python" -m pip wheel -q --no-deps --no-build-isolation -w dist ./src
run ls dist
unzip -l dist/*.whl | grep -E "_capture|kvpool/(bench|stress|daemon/pool)/__init__" | awk '{print $4}'
run "$dev_python" -m venv --without-pip venv
run "$dev_python" -m pip --python venv/bin/python install -q --no-deps dist/*.whl
"$dev_python" -c "import site; print(site.getsitepackages()[0])" > venv/lib/python3.11/site-packages/dev-venv-deps.pth
mkdir empty-path && touch not-a-dir
export PATH="$work/empty-path" HOME="$work/not-a-dir/home" XDG_CACHE_HOME="$work/not-a-dir/cache"
unset PYTHONPATH
echo "PATH=$PATH (no cc, gcc or clang: $(command -v cc gcc clang || echo none found))"
cd "$work/empty-path"
run "$work/venv/bin/python" -c "import kvpool, workers.runtime.native as n; print(kvpool.__file__); print(n.load_native())"
run "$work/venv/bin/kvpool" --help
KVPOOL_WORK_DIR="$work/kvpool-work" run "$work/venv/bin/kvpool" demo --max-tokens 8

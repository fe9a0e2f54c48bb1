#!/usr/bin/env bash
# Builds graphed's PyTorch extension against the oldest and the newest torch
# it supports (pinned below, from PyPI) and runs the Python tests against
# each, on a machine without a GPU: the extension compiles and links, loads,
# `python -m graphed.torch.check` names the torch it was built for, and the
# tests that need no GPU pass (the others skip with their reason).
#
# Each torch gets its own virtual environment, .venv/torch-<version>. The
# extension is built twice from one copy of python/: in place
# (`setup.py build_ext --inplace`, the sources then importable with
# libgraphed.so beside the extension), then installed with pip, reusing the
# objects. libgraphed.so comes from target/release (cargo build --release).
#   bash scripts/torch-compat.sh                 # the pinned oldest and newest
#   bash scripts/torch-compat.sh 2.13.0          # any versions in between
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh >/dev/null
# shellcheck disable=SC1091
source .venv/cuda-env.sh

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.15.0)

cargo build --release --quiet
library="$root/target/release/libgraphed.so"

for v in "${versions[@]}"; do
  echo "== torch $v"
  venv="$root/.venv/torch-$v"
  py="$venv/bin/python"
  if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
    python3 -m venv "$venv"
    "$py" -m pip install -q --no-cache-dir --disable-pip-version-check "torch==$v"
  fi
  # pip builds the package with this setuptools (no build isolation).
  "$py" -m pip install -q --disable-pip-version-check pytest==8.3.4 setuptools==80.9.0
  "$py" -c 'import torch; print("torch", torch.__version__, "built with CUDA", torch.version.cuda)'

  work="$(mktemp -d)"
  cp -r "$root/python" "$work/python"
  rm -rf "$work/python/build" "$work/python/src/graphed/"*.so
  export CUDA_HOME="$root/.venv/cuda" GRAPHED_PREBUILT_LIBRARY="$library" GRAPHED_INCLUDE_DIR="$root/include"
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"

  echo "-- in place (setup.py build_ext --inplace)"
  if ! (cd "$work/python" && "$py" setup.py build_ext --inplace) > "$work/inplace.log" 2>&1; then
    grep -E "error|Error" "$work/inplace.log" | head -40 || true
    echo "torch-compat: the extension does not build against torch $v (log: $work/inplace.log)" >&2
    exit 1
  fi
  (cd /tmp && PYTHONPATH="$work/python/src" "$py" -c \
    'import torch, graphed._torch_ext as e, pathlib; d = pathlib.Path(e.__file__).parent; assert (d / "libgraphed.so").is_file(), d; print("in place: the extension loads, libgraphed.so beside it in", d)')

  echo "-- pip install"
  "$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps "$work/python" > "$work/install.log" 2>&1 \
    || { tail -40 "$work/install.log"; exit 1; }
  (cd /tmp && "$py" -m graphed.torch.check)  # without a GPU: versions, then "self-test skipped"

  echo "-- pytest"
  "$py" -m pytest python/tests -q -rs -p no:cacheprovider > "$work/pytest.log" 2>&1 || {
    tail -60 "$work/pytest.log"
    echo "torch-compat: tests failed against torch $v" >&2
    exit 1
  }
  tail -1 "$work/pytest.log"
  rm -rf "$work"
done

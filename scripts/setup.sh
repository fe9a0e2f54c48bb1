#!/usr/bin/env bash
# Installs what building and testing graphed needs on a fresh Debian/Ubuntu
# machine: CMake, Ninja and GoogleTest from apt, and the CUDA 13.0 compiler
# from PyPI wheels (pinned to 13.0.x) in a project-local virtual environment,
# so that the .cu tests compile on machines without a CUDA install.
#
# Safe to run again: it only installs what is missing. Source it (or read
# .venv/cuda-env.sh afterwards) to get CUDACXX exported.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
[ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -f /usr/lib/cmake/GTest/GTestConfig.cmake ] \
  || need_apt+=(googletest libgtest-dev)
command -v g++ >/dev/null || need_apt+=(g++)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} with apt"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The CUDA 13.0 compiler from PyPI. nvidia-nvvm must be pinned too: an
# unpinned one emits a PTX version that this ptxas rejects.
venv="$root/.venv"
cuda="$venv/cuda"
if [ ! -x "$cuda/bin/nvcc" ]; then
  echo "setup: installing the CUDA 13.0 compiler wheels into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
    nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cu="$site/nvidia/cu13"
  # The wheels put everything in lib/; CMake's FindCUDAToolkit looks in lib64
  # and for an unversioned libcudart.so.
  ln -sfn lib "$cu/lib64"
  ln -sf libcudart.so.13 "$cu/lib/libcudart.so"
  ln -sfn "$cu" "$cuda"
fi
# pytest for the Python package's tests (they skip, with their reason,
# where there is no torch or no GPU).
if ! "$venv/bin/python" -c 'import pytest' 2>/dev/null; then
  echo "setup: installing pytest into $venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest==8.3.4
fi
cat > "$venv/cuda-env.sh" <<ENV
export CUDACXX="$cuda/bin/nvcc"
export CUDAToolkit_ROOT="$cuda"
ENV
# shellcheck disable=SC1091
source "$venv/cuda-env.sh"
echo "setup: done (CUDACXX=$CUDACXX, $("$CUDACXX" --version | tail -1))"

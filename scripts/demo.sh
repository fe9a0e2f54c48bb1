#!/usr/bin/env bash
# The main job: builds graphed and runs the demo (an MLP trained with graphed
# layers next to the same MLP run eagerly, the aliasing hazard and its fix,
# a strict-lease error). Uses the GPU when there is one, else the host
# backend, and says which. Installs what it needs first (scripts/setup.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh >/dev/null
# shellcheck disable=SC1091
source .venv/cuda-env.sh
build="${GRAPHED_BUILD_DIR:-$root/build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target mlp_demo >/dev/null
exec "$build/examples/mlp_demo"

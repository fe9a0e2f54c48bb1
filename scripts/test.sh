#!/usr/bin/env bash
# Runs every test of graphed on this machine, after installing what they need
# (scripts/setup.sh): the check that no module of src/ imports one that
# imports it back, the check of the documentation's links
# (scripts/check_docs.py), the Rust unit tests, then the CMake build and the
# GoogleTest suite under ctest, then the host suite again under ASan, UBSan
# and LeakSanitizer, then the C ABI fuzz target for a fixed budget
# (GRAPHED_FUZZ_SECONDS, default 180) and the thread test under
# ThreadSanitizer (both on the pinned nightly Rust, installed through
# rustup), then the Python package's tests, then the PyTorch extension
# built and tested against the oldest and the newest supported torch
# (scripts/torch-compat.sh). Without a GPU, the CUDA
# tests are compiled and skip at run time with their reason, which this
# script prints at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Each step's header says when it began; the last line, the whole time.
SECONDS=0
stage() { echo "== $* (at ${SECONDS} s)"; }
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/cuda-env.sh

stage "import circles in src/"
python3 scripts/import_cycles.py

stage "documentation: every relative link, page name and section number resolves"
python3 scripts/check_docs.py

stage "cargo test"
cargo test --release --quiet

stage "cmake build"
build="${GRAPHED_BUILD_DIR:-$root/build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build"

stage "ctest"
(cd "$build" && ctest --output-on-failure -j "$(nproc)" --timeout 600)

stage "ctest under ASan + UBSan + LeakSanitizer (host backend)"
bash scripts/sanitize.sh | grep -E "tests passed|tests failed|sanitize:"

stage "fuzz the C ABI (libFuzzer, ASan, LeakSanitizer; a fixed budget, failing on any finding)"
bash scripts/fuzz.sh "${GRAPHED_FUZZ_SECONDS:-180}"

stage "ThreadSanitizer (tests/threads.rs, std rebuilt with TSan)"
bash scripts/tsan.sh

stage "pytest (the Python package; needs torch and a GPU for most tests)"
.venv/bin/python -m pytest python/tests -q -rs -p no:cacheprovider | tail -40

stage "the PyTorch extension against the oldest and the newest supported torch (CPU: builds, loads, tests without a GPU)"
bash scripts/torch-compat.sh

bash scripts/skip-report.sh "$build"
echo "scripts/test.sh: every step passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"

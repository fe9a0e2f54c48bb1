#!/usr/bin/env bash
# Runs every test of graphed on this machine, after installing what they need
# (scripts/setup.sh): the check that no module of src/ imports one that
# imports it back, the check of the documentation's links
# (scripts/check_docs.py), the Rust unit tests, then the CMake build and the
# GoogleTest suite under ctest, then the host suite again under ASan, UBSan
# and LeakSanitizer, then the thread test under ThreadSanitizer, then the
# Python package's tests and the PyTorch extension built and tested against
# the oldest and the newest supported torch (scripts/torch-compat.sh), with
# the C ABI fuzz target running beside them for a fixed budget
# (GRAPHED_FUZZ_SECONDS, default 180; it and TSan on the pinned nightly
# Rust, installed through rustup). Without a GPU, the CUDA
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

stage "ThreadSanitizer (tests/threads.rs, std rebuilt with TSan)"
bash scripts/tsan.sh

# The fuzz target runs for a fixed time on one core: it runs beside the
# Python steps, whose extension builds take the other, and its output is
# printed (and its status checked) when they are done.
stage "fuzz the C ABI (libFuzzer, ASan, LeakSanitizer; a fixed budget, failing on any finding), in the background"
fuzz_log="$(mktemp)"
bash scripts/fuzz.sh "${GRAPHED_FUZZ_SECONDS:-180}" >"$fuzz_log" 2>&1 &
fuzz_pid=$!
# A step that fails ends the script: the fuzz target goes with it.
trap 'kill "$fuzz_pid" 2>/dev/null || true' EXIT

stage "pytest (the Python package; needs torch and a GPU for most tests)"
.venv/bin/python -m pytest python/tests -q -rs -p no:cacheprovider | tail -40

stage "the PyTorch extension against the oldest and the newest supported torch (CPU: builds, loads, tests without a GPU)"
bash scripts/torch-compat.sh

stage "the fuzz target's result"
trap - EXIT
if ! wait "$fuzz_pid"; then
  cat "$fuzz_log"
  echo "scripts/test.sh: the fuzz target failed" >&2
  exit 1
fi
tail -5 "$fuzz_log"
rm -f "$fuzz_log"

bash scripts/skip-report.sh "$build"
echo "scripts/test.sh: every step passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"

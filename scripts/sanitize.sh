#!/usr/bin/env bash
# The C and C++ suite on the host backend under AddressSanitizer,
# UndefinedBehaviorSanitizer and LeakSanitizer (the Rust library's own
# allocations go through the sanitized malloc too). CUDA is left out: the
# sanitizers cover host code. Called by scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build="${GRAPHED_ASAN_BUILD_DIR:-$root/build-asan}"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
env -u CUDACXX -u CUDAToolkit_ROOT cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build"
# Make sure the sanitizers are really in (a silent fallback would make this pass vacuously).
# (grep without -q: an early exit would kill nm with SIGPIPE under pipefail.)
if ! nm "$build/cpp_tests/graphed_tests" | grep "__asan_init" >/dev/null; then
  echo "sanitize: graphed_tests is not linked with AddressSanitizer" >&2
  exit 1
fi
(cd "$build" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure -j "$(nproc)" --timeout 600)

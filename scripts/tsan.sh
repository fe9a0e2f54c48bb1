#!/usr/bin/env bash
# Runs the multithreaded C ABI tests (tests/threads.rs, and
# tests/step_collective.rs: two ranks as threads exchanging manifests and
# all-reducing at replay) under
# ThreadSanitizer, with the standard library rebuilt with it (-Zbuild-std)
# so that TSan sees std's own synchronisation. Fails on any report.
#
# Installs the pinned nightly Rust with rust-src if it is missing; safe to
# run again. The instrumented build lives in target/tsan.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

TESTS=(--test threads --test step_collective)
TRIPLE=x86_64-unknown-linux-gnu

# shellcheck source=scripts/nightly.sh
source "$root/scripts/nightly.sh"
command -v cc >/dev/null || { echo "tsan: a C compiler (cc) is needed: apt-get install gcc" >&2; exit 1; }

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
echo "tsan: cargo +$NIGHTLY test -Zbuild-std --target $TRIPLE ${TESTS[*]} (RUSTFLAGS=-Zsanitizer=thread)"
set +e
RUSTFLAGS="-Zsanitizer=thread" RUSTDOCFLAGS="-Zsanitizer=thread" \
  CARGO_TARGET_DIR="$root/target/tsan" \
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1${TSAN_OPTIONS:+:$TSAN_OPTIONS}" \
  cargo "+$NIGHTLY" test -Zbuild-std --target "$TRIPLE" "${TESTS[@]}" >"$log" 2>&1
rc=$?
set -e
# The build's progress is left out; the test's lines, and all of it on failure.
if grep -q "WARNING: ThreadSanitizer" "$log"; then
  cat "$log"
  echo "tsan: ThreadSanitizer reported a problem (see above)" >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  cat "$log"
  echo "tsan: the test failed (exit status $rc)" >&2
  exit "$rc"
fi
grep -vE "^\s+(Compiling|Finished|Running|Updating|Downloading|Downloaded|Locking|Adding)\b" "$log" | grep -v "^$" || true
echo "tsan: clean"

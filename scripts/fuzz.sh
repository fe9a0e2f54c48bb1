#!/usr/bin/env bash
# Fuzzes the C ABI (fuzz/fuzz_targets/c_abi.rs) with libFuzzer under
# AddressSanitizer and LeakSanitizer, debug assertions and overflow checks
# on, for a fixed budget over the committed corpus (fuzz/corpus/c_abi).
# Exits non-zero on any finding and prints the input that caused it.
#
#   bash scripts/fuzz.sh [SECONDS]     (or FUZZ_SECONDS; default 180)
#
# Installs what it needs on a fresh Debian machine (a C++ compiler for
# libFuzzer, the pinned nightly Rust with rust-src, cargo-fuzz) and is safe
# to run again. New inputs go to fuzz/corpus/.work-c_abi (ignored by git).
# To refresh the committed corpus: copy the new inputs into it, minimise it
# with `cargo fuzz cmin c_abi`, then keep a set cover of its features
# (the binary's -set_cover_merge=1 into an empty folder).
# GRAPHED_FUZZ_WAIVE=name,... switches off the checks of known bugs (see
# the target's header); GRAPHED_FUZZ_TRACE=1 prints the ops of an input.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

CARGO_FUZZ_VERSION=0.13.2
TARGET=c_abi
seconds="${1:-${FUZZ_SECONDS:-180}}"

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if ! command -v c++ >/dev/null; then
  echo "fuzz: installing g++ with apt (libFuzzer is compiled from source)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq g++ >/dev/null
fi
# shellcheck source=scripts/nightly.sh
source "$root/scripts/nightly.sh"
if [ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
  echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
fi

echo "fuzz: building $TARGET ($NIGHTLY, ASan, debug assertions, overflow checks)"
cargo "+$NIGHTLY" fuzz build "$TARGET" --debug-assertions --release

corpus="fuzz/corpus/$TARGET"
work="fuzz/corpus/.work-$TARGET"
artifacts="fuzz/artifacts/$TARGET"
mkdir -p "$work" "$artifacts"
log="$artifacts/fuzz.log"
# Huge allocations the library asks for are refused (it must answer
# OUT_OF_MEMORY), not reported as allocator errors.
export ASAN_OPTIONS="allocator_may_return_null=1:detect_leaks=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
echo "fuzz: running $TARGET for ${seconds}s over $corpus (log: $log)"
start=$(date +%s)
set +e
cargo "+$NIGHTLY" fuzz run "$TARGET" --debug-assertions --release "$work" "$corpus" -- \
  -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$artifacts/" >"$log" 2>&1
rc=$?
set -e
end=$(date +%s)
grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)" "$log" | tail -2 || true
grep -E "^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)" "$log" || true
echo "fuzz: ran $((end - start))s, exit status $rc"
if [ "$rc" -ne 0 ]; then
  echo "fuzz: FINDING in $TARGET:" >&2
  grep -E -m1 -A6 "panicked at|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|ALARM|SUMMARY" "$log" >&2 || tail -40 "$log" >&2
  for f in $(grep -oE "Test unit written to [^ ]+" "$log" | awk '{print $5}'); do
    echo "fuzz: crash input: $root/$f" >&2
    echo "fuzz: replay it: GRAPHED_FUZZ_TRACE=1 cargo +$NIGHTLY fuzz run $TARGET --debug-assertions --release $f" >&2
  done
  exit 1
fi
echo "fuzz: no finding"

#!/usr/bin/env bash
# Sourced by scripts/fuzz.sh and scripts/tsan.sh: the pinned nightly Rust
# they build with (sanitizers, -Zbuild-std), installed through rustup with
# rust-src when it is missing. Sets NIGHTLY.
NIGHTLY=nightly-2026-05-20
if ! command -v rustup >/dev/null; then
  echo "nightly: rustup is needed (https://rustup.rs); install it, then run this again" >&2
  exit 1
fi
if ! rustup run "$NIGHTLY" rustc --version >/dev/null 2>&1 \
  || ! [ -d "$(rustup run "$NIGHTLY" rustc --print sysroot)/lib/rustlib/src/rust/library" ]; then
  echo "nightly: installing Rust $NIGHTLY with rust-src"
  rustup toolchain install "$NIGHTLY" --profile minimal --component rust-src
fi

#!/usr/bin/env bash
# For a GPU machine without Rust or network: installs the graphed package
# into the current Python from a prebuilt libgraphed.so (no build isolation,
# no dependencies, no index), then runs `python -m graphed.torch.check`, the
# example, the pytest suite and the comparison with torch. Logs, pytest's JUnit XML and
# the report (pytorch.md) go to $OUT when set, else python/build-gpu/.
#   GRAPHED_PREBUILT_LIBRARY=target/release/libgraphed.so bash python/gpu-test.sh
# Options: --no-compare (skip the comparison), --compare-only.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/python/build-gpu}"
mkdir -p "$out"
export GRAPHED_PREBUILT_LIBRARY="${GRAPHED_PREBUILT_LIBRARY:-$root/target/release/libgraphed.so}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
compare=1 tests=1
for arg in "$@"; do
  case "$arg" in
    --no-compare) compare=0 ;;
    --compare-only) tests=0 ;;
  esac
done

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
echo "commit: ${GRAPHED_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}"

echo "== install (library: $GRAPHED_PREBUILT_LIBRARY)"
if python3 -m pip install --no-build-isolation --no-deps --no-index "$root/python" > "$out/install.log" 2>&1; then
  tail -1 "$out/install.log"
else
  # pip could not make a wheel (an old setuptools without the wheel package,
  # say): build the extension in place and use the sources instead.
  tail -20 "$out/install.log"
  echo "pip install failed; building in place and using python/src instead"
  (cd "$root/python" && python3 setup.py build_ext --inplace) > "$out/build-inplace.log" 2>&1 \
    || { tail -60 "$out/build-inplace.log"; exit 1; }
  export PYTHONPATH="$root/python/src${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== check"
(cd /tmp && python3 -m graphed.torch.check) 2>&1 | tee "$out/check.log"
status=${PIPESTATUS[0]}

if [ "$tests" = 1 ]; then
  echo "== example"
  python3 "$root/examples/torch_extension/train.py" 2>&1 | tee "$out/train.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "== pytest"
  # On this machine every GPU test must run: a missing GPU or extension fails.
  (cd "$root" && GRAPHED_REQUIRE_GPU=1 python3 -m pytest python/tests -q -rs --junitxml="$out/pytest.xml") > "$out/pytest.log" 2>&1
  pytest_status=$?
  grep -E "passed|failed|error" "$out/pytest.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -40
  echo "pytest exit status $pytest_status"
  [ "$pytest_status" = 0 ] || status=1
fi

if [ "$compare" = 1 ]; then
  echo "== comparison with torch"
  PYTHONUNBUFFERED=1 python3 "$root/examples/torch_extension/compare.py" --out "$out/pytorch.md" \
    --commit "${GRAPHED_COMMIT:-unknown}" > "$out/compare.log" 2>&1
  compare_status=$?
  echo "compare exit status $compare_status"
  tail -80 "$out/compare.log"
  [ "$compare_status" = 0 ] || status=1
fi
exit "$status"

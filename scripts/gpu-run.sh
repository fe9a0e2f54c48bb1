#!/usr/bin/env bash
# For the GPU machine (it has nvcc, CMake, Ninja and GoogleTest but no Rust):
# configures the CMake build against the prebuilt library carried in at
# target/release/libgraphed.so, builds the CUDA tests with the local nvcc,
# runs ctest and the demo and prints a summary. Options:
#   --bench     also run the benchmarks (report in $out/benchmarks.md), with
#               torch's side of the step and memory tables measured first
#   --sanitize  also run the CUDA test instances under compute-sanitizer
#               memcheck and racecheck
#   --torch     also build and run the libtorch program, and install and test
#               the Python package (python/gpu-test.sh; its comparison report
#               in $out/pytorch.md unless --no-compare)
#   --no-compare  with --torch: skip the PyTorch comparison (a separate run)
#   --param-guard  moved parameters alone: the guard and the rebind
#               (graphed_bench --param-guard; also in --bench), report in
#               $out/param_guard.md
#   --microbatches  N microbatches in one step graph against N launches
#               (graphed_bench --microbatches; also in --bench), report in
#               $out/microbatches.md
#   --step-update  the whole iteration with the optimizer inside the step:
#               the C++ table (graphed_bench --step-update; also in --bench)
#               and, when the package is installed (after --torch), its
#               Python counterpart (benches/torch_step_optimizer.py --model
#               mlp); reports in $out/step_update.md and $out/step_opt_mlp.md
#   --capture   capture time: the C++ table (graphed_bench --capture-only)
#               and, when the package is installed (after --torch), the
#               nanoGPT blocks against torch (capture_time.py); reports in
#               $out/capture_cpp.md and $out/capture_py.md
# Logs go to $OUT when set (the device tool's output folder). Every step
# runs; the exit status is non-zero when any failed. CUDA test instances
# fail here, instead of skipping, when the CUDA backend does not come up.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
lib="${GRAPHED_PREBUILT_LIBRARY:-$root/target/release/libgraphed.so}"
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
build="$root/build-gpu"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$nvcc" --version | tail -2
# The machine gets a copy of the working tree without history: the caller
# passes the commit in GRAPHED_COMMIT.
echo "commit: ${GRAPHED_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

echo "== configure + build"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRAPHED_PREBUILT_LIBRARY="$lib" -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 \
  > "$out/configure.log" 2>&1 || { cat "$out/configure.log"; exit 1; }
grep "graphed:" "$out/configure.log"
cmake --build "$build" -j "$(nproc)" > "$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }

# Every step runs; any failure makes the exit status non-zero.
export GRAPHED_REQUIRE_CUDA=1
status=0
fail() { echo "FAILED: $1"; status=1; }

echo "== ctest"
(cd "$build" && ctest --output-on-failure --timeout 300 2>&1) | tee "$out/ctest.log" | grep -E "tests passed|tests failed|Failed|\*\*\*"
[ "${PIPESTATUS[0]}" = 0 ] || fail ctest
cp "$build/Testing/Temporary/LastTest.log" "$out/LastTest.log" 2>/dev/null || true
bash scripts/skip-report.sh "$build"
grep -E "tests passed|tests failed" "$out/ctest.log"

echo "== demo"
"$build/examples/mlp_demo" 2>&1 | tee "$out/demo.log" | tail -30
[ "${PIPESTATUS[0]}" = 0 ] || fail demo

no_compare=""
for arg in "$@"; do [ "$arg" = "--no-compare" ] && no_compare="--no-compare"; done

for arg in "$@"; do
  case "$arg" in
    --sanitize)
      echo "== compute-sanitizer memcheck (CUDA instances)"
      # API errors are not reported: the rebinding planner reads kernel
      # arguments until the driver answers there is none (drivers without
      # cuFuncGetParamCount), an error it handles.
      compute-sanitizer --tool memcheck --error-exitcode 1 --leak-check full --report-api-errors no \
        "$build/cpp_tests/graphed_tests" --gtest_filter='*cuda*:-*IllegalCallUnderCapture*' > "$out/memcheck.log" 2>&1
      rc=$?; echo "memcheck exit status $rc"; [ $rc = 0 ] || fail memcheck
      grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -4
      echo "== compute-sanitizer racecheck (CUDA instances)"
      compute-sanitizer --tool racecheck --error-exitcode 1 \
        "$build/cpp_tests/graphed_tests" --gtest_filter='*cuda*:-*IllegalCallUnderCapture*' > "$out/racecheck.log" 2>&1
      rc=$?; echo "racecheck exit status $rc"; [ $rc = 0 ] || fail racecheck
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/racecheck.log" | tail -4
      ;;
    --torch)
      echo "== libtorch program"
      prefix="$build/install"
      cmake --install "$build" --prefix "$prefix" > "$out/install.log" 2>&1
      torch_prefix="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
      cmake -S examples/libtorch_mlp -B "$root/build-libtorch" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix" > "$out/libtorch-configure.log" 2>&1 \
        && cmake --build "$root/build-libtorch" > "$out/libtorch-build.log" 2>&1 \
        || { fail "libtorch build"; tail -40 "$out/libtorch-configure.log" "$out/libtorch-build.log"; }
      if [ -x "$root/build-libtorch/libtorch_mlp" ]; then
        "$root/build-libtorch/libtorch_mlp" 2>&1 | tee "$out/libtorch.log"
        rc=${PIPESTATUS[0]}; echo "libtorch exit status $rc"; [ "$rc" = 0 ] || fail libtorch
      fi
      echo "== the Python package"
      GRAPHED_PREBUILT_LIBRARY="$lib" bash python/gpu-test.sh $no_compare || fail "the Python package"
      ;;
    --capture)
      echo "== capture time"
      "$build/benches/graphed_bench" --capture-only --out "$out/capture_cpp.md" > "$out/capture_cpp.log" 2>&1
      rc=$?; echo "capture bench exit status $rc"; [ $rc = 0 ] || fail "capture bench"
      grep "^|" "$out/capture_cpp.md"
      if python3 -c 'import graphed.torch' 2>/dev/null; then
        (cd /tmp && PYTHONUNBUFFERED=1 python3 "$root/examples/torch_extension/capture_time.py" --blocks 6,24 \
          --rounds 3 --out "$out/capture_py.md" --json "$out/capture_py.json") > "$out/capture_py.log" 2>&1
        rc=$?; echo "capture_time.py exit status $rc"; [ $rc = 0 ] || fail "capture_time.py"
        grep "^|" "$out/capture_py.md"
      else
        echo "capture_time.py: not run (the graphed package is not installed: pass --torch first)"
      fi
      ;;
    --step-update)
      echo "== the whole iteration: the optimizer inside the step (C++)"
      "$build/benches/graphed_bench" --step-update --out "$out/step_update.md" > "$out/step_update.log" 2>&1
      rc=$?; echo "step update bench exit status $rc"; [ $rc = 0 ] || { fail "step update bench"; tail -20 "$out/step_update.log"; }
      grep -E "^\||^target" "$out/step_update.md"
      if python3 -c 'import graphed.torch' 2>/dev/null; then
        echo "== the whole iteration from Python (torch_step_optimizer.py --model mlp)"
        python3 benches/torch_step_optimizer.py --model mlp --out "$out/step_opt_mlp.md" > "$out/step_opt_mlp.log" 2>&1
        rc=$?; echo "torch_step_optimizer exit status $rc"; [ $rc = 0 ] || { fail torch_step_optimizer; tail -20 "$out/step_opt_mlp.log"; }
        grep -E "^\||^target" "$out/step_opt_mlp.md"
      else
        echo "torch_step_optimizer.py: not run (the graphed package is not installed: pass --torch first)"
      fi
      ;;
    --microbatches)
      echo "== microbatches in one step graph"
      "$build/benches/graphed_bench" --microbatches --out "$out/microbatches.md" > "$out/microbatches.log" 2>&1
      rc=$?; echo "microbatch bench exit status $rc"; [ $rc = 0 ] || { fail "microbatch bench"; tail -20 "$out/microbatches.log"; }
      grep "^|" "$out/microbatches.md"
      echo "== torch's side: N microbatches accumulated in .grad"
      python3 benches/torch_accumulate.py --out "$out/torch_accumulate.md" > "$out/torch_accumulate.log" 2>&1
      rc=$?; echo "torch_accumulate exit status $rc"; [ $rc = 0 ] || { fail torch_accumulate; tail -20 "$out/torch_accumulate.log"; }
      grep "^|" "$out/torch_accumulate.md"
      ;;
    --param-guard)
      echo "== moved parameters: the guard and the rebind"
      "$build/benches/graphed_bench" --param-guard --out "$out/param_guard.md" > "$out/param_guard.log" 2>&1
      rc=$?; echo "param guard bench exit status $rc"; [ $rc = 0 ] || { fail "param guard bench"; tail -20 "$out/param_guard.log"; }
      grep "^|" "$out/param_guard.md"
      ;;
    --bench)
      echo "== torch's side of the step benchmark"
      python3 benches/torch_reference.py --layers 24 --width 256 --batch 64 --out "$out/torch_reference.json" \
        > "$out/torch_reference.log" 2>&1
      rc=$?; echo "torch_reference exit status $rc"; [ $rc = 0 ] || fail torch_reference
      tail -2 "$out/torch_reference.log"
      echo "== benchmarks"
      "$build/benches/graphed_bench" --out "$out/benchmarks.md" --torch-json "$out/torch_reference.json" \
        > "$out/bench.log" 2>&1
      rc=$?; echo "bench exit status $rc"; [ $rc = 0 ] || fail benchmarks
      cat "$out/bench.log"
      ;;
  esac
done
exit "$status"

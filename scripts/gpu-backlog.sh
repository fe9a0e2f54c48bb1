#!/usr/bin/env bash
# For the GPU machine, in one call of at most 10 minutes (DEADLINE seconds,
# default 570): what runs/gpu-runs.md lists as not yet run. Builds the C++
# tests and benchmarks (NCCL found through the machine's PyTorch) and
# installs the Python package in parallel, then runs the whole graphed_tests
# suite, the one-rank NCCL suite, the update stage's C++ rows, the libtorch
# program, the bucket, capture-failure and data-parallel step tests from
# PyTorch (the expected failures once more with --runxfail, to see what
# they raise), and memcheck over the newest CUDA suites with the time left.
# `bash scripts/gpu-backlog.sh bench` (a second call, the machine still
# warm): the PyTorch benchmarks not yet run (batch-first buckets, the
# whole iteration with the optimizer inside, with the all-reduce inside).
# Logs go to $OUT. Carry target/release/libgraphed.so.
set -uo pipefail
export PATH=/opt/torch/.venv/bin:$PATH NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
root=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
D=${DEADLINE:-570}
export GRAPHED_PREBUILT_LIBRARY=$root/target/release/libgraphed.so TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=8 GRAPHED_REQUIRE_CUDA=1 GRAPHED_REQUIRE_GPU=1
if [ "${1:-tests}" = bench ]; then
python3 -c "import graphed.torch" 2>/dev/null || { python3 -m pip install --no-build-isolation --no-deps --no-index ./python > $OUT/pip.log 2>&1; echo "pip rc $? at $(el)s"; }
timeout 200 python3 benches/torch_varlen_bt.py --out $OUT/torch_varlen_bt.md > $OUT/torch_varlen_bt.log 2>&1; echo "bt rc $? at $(el)s"; tail -5 $OUT/torch_varlen_bt.log; cat $OUT/torch_varlen_bt.md
timeout 100 python3 benches/torch_step_optimizer.py --model mlp --rounds 3 --iters 30 --out $OUT/step_opt_mlp.md > $OUT/stepopt.log 2>&1; echo "stepopt mlp rc $? at $(el)s"; tail -3 $OUT/stepopt.log; cat $OUT/step_opt_mlp.md
timeout 100 python3 benches/torch_step_optimizer.py --model mlp --ddp --rounds 3 --iters 30 --out $OUT/step_opt_ddp.md > $OUT/stepoptddp.log 2>&1; echo "stepopt ddp rc $? at $(el)s"; tail -3 $OUT/stepoptddp.log; cat $OUT/step_opt_ddp.md
timeout $(( D - $(el) - 5 )) python3 benches/torch_step_optimizer.py --model gpt --rounds 3 --iters 20 --out $OUT/step_opt_gpt.md > $OUT/stepoptgpt.log 2>&1; echo "stepopt gpt rc $? at $(el)s"; tail -3 $OUT/stepoptgpt.log; cat $OUT/step_opt_gpt.md
exit 0
fi
nvidia-smi --query-gpu=name --format=csv,noheader
( cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRAPHED_PREBUILT_LIBRARY=$GRAPHED_PREBUILT_LIBRARY \
    -DCMAKE_CUDA_COMPILER=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc) -DCMAKE_CUDA_ARCHITECTURES=90 -DGRAPHED_PYTHON=/opt/torch/.venv/bin/python3 \
  && cmake --build build-gpu -j 8 --target graphed_tests graphed_bench step_collective_nccl_tests ) > $OUT/cbuild.log 2>&1 &
cb=$!
python3 -m pip install --no-build-isolation --no-deps --no-index ./python > $OUT/pip.log 2>&1; echo "pip rc $? at $(el)s"; tail -1 $OUT/pip.log
wait $cb; echo "cmake rc $? at $(el)s"; tail -3 $OUT/cbuild.log
( cmake --install build-gpu --prefix build-gpu/install && cmake -S examples/libtorch_mlp -B build-libtorch -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)');$root/build-gpu/install" && cmake --build build-libtorch ) > $OUT/libtorch-build.log 2>&1 &
lb=$!
timeout 150 build-gpu/cpp_tests/graphed_tests --gtest_brief=1 > $OUT/gtest.log 2>&1; echo "gtest rc $? at $(el)s"
grep -E "PASSED|FAILED|Failure|Expected|Which is|exception|tests ran|Value of|Actual" $OUT/gtest.log | head -50
grep "NCCL" $OUT/cbuild.log | head -2
NCCL_NVLS_ENABLE=0 timeout 60 build-gpu/cpp_tests/step_collective_nccl_tests --gtest_brief=1 > $OUT/nccl.log 2>&1; echo "nccl rc $? at $(el)s"; grep -E "PASSED|FAILED|Failure|Expected|Which is|SKIPPED|tests ran|error" $OUT/nccl.log | head -20
timeout 60 build-gpu/benches/graphed_bench --step-update --out $OUT/step_update.md > $OUT/stepupd.log 2>&1; echo "step-update bench rc $? at $(el)s"; tail -14 $OUT/step_update.md
wait $lb; echo "libtorch build rc $? at $(el)s"; tail -3 $OUT/libtorch-build.log
timeout 90 build-libtorch/libtorch_mlp > $OUT/libtorch.log 2>&1; echo "libtorch rc $? at $(el)s"; grep -iE "fail|mismatch|section|ok|equal" $OUT/libtorch.log | tail -20
(cd /tmp && timeout 170 python3 -m pytest $root/python/tests/test_buckets_dims.py $root/python/tests/test_capture_failures.py $root/python/tests/test_buckets.py -q -rsx -p no:cacheprovider --maxfail=12) > $OUT/pytest.log 2>&1; echo "pytest rc $? at $(el)s"
grep -E "passed|failed|error" $OUT/pytest.log | tail -2; grep -E "^(FAILED|ERROR|XFAIL|XPASS)|^E  " $OUT/pytest.log | head -60
echo "== the operator watch in a fresh process"
(cd /tmp && python3 -c "
import torch, graphed.torch
from graphed import _torch_ext as e
print('fresh, no cuda:', repr(e._failure_report(lambda: torch.ones(2).view(3))))
torch.zeros(1, device='cuda')
print('after cuda init:', repr(e._failure_report(lambda: torch.ones(2).view(3))))
")
(cd /tmp && timeout 120 python3 -m pytest $root/python/tests/test_capture_failures.py -q -p no:cacheprovider --runxfail -k "item or stream_the_capture or captures_again or torch_operator" ) > $OUT/xf.log 2>&1; echo "xf rc $?"; grep -E "^E  |passed|failed" $OUT/xf.log | head -40
(cd /tmp && NCCL_NVLS_ENABLE=0 timeout 150 python3 -m pytest $root/python/tests/test_step_ddp.py $root/python/tests/test_distributed.py -q -rs -p no:cacheprovider) > $OUT/ddp.log 2>&1; echo "ddp rc $? at $(el)s"; grep -E "passed|failed" $OUT/ddp.log | tail -1; grep -E "^(FAILED|ERROR)|^E  " $OUT/ddp.log | head -30
timeout $(( D - $(el) - 5 )) compute-sanitizer --tool memcheck --report-api-errors no --leak-check full build-gpu/cpp_tests/graphed_tests --gtest_brief=1 --gtest_filter='*StepUpdate*:*StepCollective*:*CaptureFailures*:*TimeAndGrid*:*OtherDimensions*:*MovedParametersFollowBuckets*' > $OUT/memcheck.log 2>&1; echo "memcheck rc $? at $(el)s"; grep -E "ERROR SUMMARY|PASSED|FAILED" $OUT/memcheck.log | tail -5

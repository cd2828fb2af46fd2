#!/usr/bin/env bash
# The GPU check: every CUDA kernel against the CPU reference on fresh random inputs, then the kernel
# benchmarks, in one short table. Two halves:
#
#   scripts/gpu-check.sh --prepare   here, on a machine with nvcc but no GPU: builds the kernel library,
#                                    its tests and benchmark into build-gpu/ (KARAKV_KERNELS_ONLY: no
#                                    gRPC needed), and copies the shared libraries they need that are
#                                    not part of the C library (ldd) plus GoogleTest (to rebuild there)
#                                    into build-gpu/carry/.
#   scripts/gpu-check.sh             on the GPU machine (nvcc, cmake, ninja and PyTorch, no network, no
#                                    Debian libraries): runs the carried binaries, or rebuilds them with
#                                    that machine's nvcc when the carried ones cannot start (e.g. an
#                                    older driver), then prints the table.
#
# Fits one 10-minute call on an H200: the correctness run takes seconds, each benchmark well under a
# minute. Environment: GPU_CHECK_SEQS (64), GPU_CHECK_TOKENS (8192), GPU_CHECK_ITERS (10).
# What to carry (about 16 MiB; the object files in build-gpu/ need not travel):
#   build-gpu/tests/kernels/kernels_test  build-gpu/bench/kernels/kernels_bench  build-gpu/carry
set -uo pipefail
cd "$(dirname "$0")/.."
B=build-gpu

if [ "${1:-}" = "--prepare" ]; then
  set -e
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKARAKV_KERNELS_ONLY=ON -DKARAKV_CUDA=ON > /dev/null
  cmake --build "$B" -j "$(nproc)" --target kernels_test kernels_bench
  rm -rf "$B/carry" && mkdir -p "$B/carry/lib"
  for bin in "$B/tests/kernels/kernels_test" "$B/bench/kernels/kernels_bench"; do
    ldd "$bin" | awk '/=> \//{print $3}' | grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so' |
      xargs -r -I{} cp -L {} "$B/carry/lib/"
  done
  # GoogleTest for a rebuild on the GPU machine, in the layout its CMake package expects.
  mkdir -p "$B/carry/gtest/lib/x86_64-linux-gnu/cmake" "$B/carry/gtest/include"
  cp -r /usr/include/gtest /usr/include/gmock "$B/carry/gtest/include/"
  cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a "$B/carry/gtest/lib/x86_64-linux-gnu/"
  cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$B/carry/gtest/lib/x86_64-linux-gnu/cmake/"
  du -sh "$B/tests/kernels/kernels_test" "$B/bench/kernels/kernels_bench" "$B/carry"
  echo "prepared $B; run scripts/gpu-check.sh on the GPU machine carrying $B"
  exit 0
fi

if ! nvidia-smi -L > /dev/null 2>&1; then
  echo "no device: nvidia-smi finds no GPU here; run this on the GPU machine (scripts/gpu-check.sh --prepare is for here)"
  exit 77
fi
export LD_LIBRARY_PATH="$PWD/$B/carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SEQS=${GPU_CHECK_SEQS:-64}
TOKENS=${GPU_CHECK_TOKENS:-8192}
ITERS=${GPU_CHECK_ITERS:-10}
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"

# The carried build, unless it cannot create the backend here; then rebuild with this machine's nvcc.
if ! "$B/bench/kernels/kernels_bench" --backend=cuda --seqs=1 --tokens=128 --iters=1 > /tmp/gpu-probe.txt 2>&1; then
  echo "carried build cannot run here: $(tail -1 /tmp/gpu-probe.txt); rebuilding with $(nvcc --version | tail -1)"
  rm -rf build-gpu-local
  cmake -S . -B build-gpu-local -G Ninja -DCMAKE_BUILD_TYPE=Release -DKARAKV_KERNELS_ONLY=ON -DKARAKV_CUDA=ON \
    -DGTest_DIR="$PWD/$B/carry/gtest/lib/x86_64-linux-gnu/cmake/GTest" > /tmp/gpu-cmake.txt 2>&1 ||
    { cat /tmp/gpu-cmake.txt; exit 1; }
  cmake --build build-gpu-local -j "$(nproc)" --target kernels_test kernels_bench > /tmp/gpu-build.txt 2>&1 ||
    { tail -40 /tmp/gpu-build.txt; exit 1; }
  B=build-gpu-local
fi

# 1. Correctness: every op of the cuda backend against the CPU reference (backend_ops_test).
"$B/tests/kernels/kernels_test" --gtest_filter='AllBackends/BackendOpsTest.*/cuda_*' --gtest_brief=1 \
  > /tmp/gpu-tests.txt 2>&1
tests_rc=$?
grep -E "Failure|FAILED|Expected|Which is|error" /tmp/gpu-tests.txt | head -60
passed=$(grep -oE '\[  PASSED  \] [0-9]+' /tmp/gpu-tests.txt | grep -oE '[0-9]+$' || echo 0)
failed=$(grep -oE '[0-9]+ FAILED TEST' /tmp/gpu-tests.txt | grep -oE '^[0-9]+' || echo 0)
skipped=$(grep -oE '\[  SKIPPED \] [0-9]+ test' /tmp/gpu-tests.txt | grep -oE '[0-9]+' | head -1 || echo 0)

# 2. Benchmarks, both geometries, and PyTorch SDPA on the same problem.
declare -A r
for model in smollm2 llama8b; do
  "$B/bench/kernels/kernels_bench" --backend=cuda --model=$model --seqs="$SEQS" --tokens="$TOKENS" --iters="$ITERS" \
    > /tmp/gpu-bench-$model.txt 2>&1 || { echo "kernels_bench $model failed:"; tail -5 /tmp/gpu-bench-$model.txt; }
  python3 bench/kernels/sdpa_bench.py --model=$model --seqs="$SEQS" --tokens="$TOKENS" \
    > /tmp/gpu-sdpa-$model.txt 2>&1 || { echo "sdpa_bench $model failed:"; tail -5 /tmp/gpu-sdpa-$model.txt; }
  while read -r name value unit; do
    case "$name" in \#*|"") continue ;; esac
    r[$model.$name]=$value
  done < <(cat /tmp/gpu-bench-$model.txt /tmp/gpu-sdpa-$model.txt)
  head -1 /tmp/gpu-bench-$model.txt
done
head -1 /tmp/gpu-sdpa-llama8b.txt

ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(a)/float(b):.2f}' if a and b else 'n/a')" "${1:-}" "${2:-}"; }
echo
echo "| check | smollm2-135m | llama-3.1-8b |"
echo "| --- | --- | --- |"
echo "| cuda ops vs CPU reference (tests passed / failed / skipped) | $passed / $failed / $skipped | (same run) |"
for m in decode_layer_us decode_step_ms decode_bandwidth copy_bandwidth decode_vs_copy sdpa_layer_us sdpa_bandwidth \
         kara_tick_ms kara_tick_vs_decode_step; do
  echo "| $m | ${r[smollm2.$m]:-n/a} | ${r[llama8b.$m]:-n/a} |"
done
echo "| paged decode time / sdpa time | $(ratio "${r[smollm2.decode_layer_us]:-}" "${r[smollm2.sdpa_layer_us]:-}") | $(ratio "${r[llama8b.decode_layer_us]:-}" "${r[llama8b.sdpa_layer_us]:-}") |"
echo "($SEQS sequences x $TOKENS tokens, fp16; targets: decode_vs_copy >= 0.70, paged/sdpa <= 1.00)"
echo "Not run here: the two-process CUDA IPC staging test (CUDA IPC staging is not built yet)."
exit $tests_rc

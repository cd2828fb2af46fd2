#!/usr/bin/env bash
# The GPU check: every CUDA kernel against the CPU reference on fresh random inputs (the decode tests
# once more with FlashInfer's decode, KARAKV_CUDA_ATTENTION=flashinfer), the kernel benchmarks (fp16
# decode by both), the two-process device staging test (CUDA IPC) and karakv-bench serve on the GPU,
# in one short table. Two halves:
#
#   scripts/gpu-check.sh --prepare   here, on a machine with nvcc but no GPU: fetches FlashInfer's headers
#                                    (scripts/fetch_flashinfer.sh) and packs them (2 MB) for a rebuild
#                                    there; builds the kernel library,
#                                    its tests and benchmark into build-gpu/ (KARAKV_KERNELS_ONLY: no
#                                    gRPC needed; libstdc++ and libgcc linked in statically), and copies
#                                    the shared libraries they still need that are not part of the C
#                                    library (ldd; none since the kernels left OpenMP) plus GoogleTest (its sources, and the built
#                                    libraries, to rebuild there) into build-gpu/carry/. Then the full
#                                    CUDA build (build-gpu-full/: karakvd, karakv-bench,
#                                    device_staging_test, which need gRPC) goes to build-gpu/carry/full/
#                                    with every shared library they load, the C library and its
#                                    dynamic loader included (not the CUDA driver): patchelf points the
#                                    binaries at that loader (a path relative to the repository root,
#                                    where this script runs them) and at ../lib, so they start on a
#                                    machine with an older C library and no gRPC; packed as
#                                    build-gpu/carry/full.tar.xz. Needs patchelf.
#   scripts/gpu-check.sh [--results DIR]
#                                    on the GPU machine (nvcc, cmake, ninja and PyTorch, no network, no
#                                    Debian libraries): runs the carried binaries, or rebuilds the kernel
#                                    ones with that machine's nvcc when they cannot start there, then
#                                    prints the table and writes every output (the serve CSVs, the
#                                    gtest XML, each step's log, and targets.csv: the kernel targets
#                                    of issue 39 in karakv-bench's CSV columns) into DIR (default
#                                    gpu-results/).
#                                    With no GPU (nvidia-smi finds none) it says "no device" and exits 0.
#   scripts/gpu-check.sh --help      this text.
#
# "Cannot start" means the dynamic loader refuses a carried binary (an older C library than this
# one's: `kernels_test --gtest_list_tests` or `kernels_bench --help` fails), or the CUDA driver
# refuses the runtime it was built with (cudaErrorInsufficientDriver and the like when the backend
# is created). Any other failure is a result, reported in the table, not a reason to rebuild. The
# carried libraries are put on the library path of the carried binaries' own processes only: cmake,
# nvcc, the rebuilt binaries, python3 and PyTorch run with this machine's libraries.
#
# The table has one row per test step: tests passed / failed / skipped, counted once per test from
# gtest's per-test result lines, and the exit status (above 128: a crash, with the signal and the test
# it was running). The script exits with the tests' status, or 1 when no test passed or a test was
# skipped for "no device" (the CUDA backend could not be created on the GPU machine).
#
# Meant to finish within 8 minutes on an H200 (a 10-minute call with room for a rerun; the first
# run, 2026-12-04, took 246 s before the profile step and the P3 row with staging written once): the
# correctness runs (every op at five geometries and three dtypes) take about two minutes, one dtype's
# ops under compute-sanitizer memcheck at most GPU_CHECK_MEMCHECK_TIMEOUT, the attention tests under
# synccheck and racecheck at most 60 and 90 seconds, each kernel benchmark (fp16 decode, a Kara
# tick, and decode straight from each quantized format: kivi2, kivi4, tq2, tq3, tq4) well under a minute, karakv-bench serve (none, snapkv, kara at max batch 64 and 256, then kara at 256
# with workers on device staging) at most GPU_CHECK_SERVE_SECONDS per run, and karakv-bench p3
# (a Step through device staging, then shm staging, against an empty Ping) seconds; not yet timed
# on a GPU: the decode tests and benchmarks again with FlashInfer's decode (estimated at two minutes
# more), the quantized tests and benchmark again with the fused quantized decode
# (KARAKV_CUDA_QUANT_DECODE=fused; estimated at a minute more), every op at the default geometry
# with deferred waits (the stream order; estimated at 30 s), two more P3 runs and one more serve run
# stream-ordered by CUDA events (GPU_CHECK_SERVE_SECONDS + 30 s), and the mps step (the device-staging Step and serve run again under NVIDIA's MPS, whose
# control daemon it starts and quits; bounded by GPU_CHECK_SERVE_SECONDS + 6 minutes of timeouts). Environment: GPU_CHECK_SEQS (64), GPU_CHECK_TOKENS (8192),
# GPU_CHECK_ITERS (10), GPU_CHECK_TEST_TIMEOUT (300 seconds for the test step; kernels_bench gets
# 240 seconds per model, sdpa_bench 180), GPU_CHECK_SERVE_STEPS (300: too few for any context to grow long enough to compact; the
# compaction seconds in the serve rows say whether the policies did anything), GPU_CHECK_SERVE_SECONDS (20),
# GPU_CHECK_SERVE_BATCHES (64,256), GPU_CHECK_SERVE_POLICIES (none,snapkv,kara), GPU_CHECK_TEST_FILTER
# (the test step's gtest filter; default every cuda op test, the flashinfer decode tests, the
# fused quantized ones and the deferred ones), GPU_CHECK_MEMCHECK_TIMEOUT (120),
# GPU_CHECK_JOBS (nproc; build jobs), GPU_CHECK_STEPS (tests,sanitize,bench,ipc,serve,staging,mps,profile:
# a rerun after a fix can take only the steps that failed; the others print "skipped"; `deploy`, not
# in the default list, is issue 39 item 5's serve run: Llama-3.1-8B's geometry with workers running
# their projections and MLP on the GPU with cuBLAS, about GPU_CHECK_DEPLOY_SECONDS (120) per policy;
# GPU_CHECK_DEPLOY_POLICIES, _BATCH (64), _STEPS (6000), _POOL (16GiB), _ORDERED (false: true runs the
# workers stream-ordered by CUDA events); the GPU's utilization is sampled with nvidia-smi during it). The profile
# step runs Nsight Compute (ncu, where the machine has it; --clock-control none, so the GPU's clocks
# are left alone) over the paged decode (own and FlashInfer's) and the quantized decode kernels
# (staged and fused), at
# most 120 s per run.
# What to carry (the object files in build-gpu/ and build-gpu-full/ need not travel; --prepare prints
# the sizes and fails above 60 MiB): build-gpu/carry, which holds the kernel binaries packed
# (kernels.tar.xz: with FlashInfer's instantiations they are 53 MB unpacked, 10 MB packed), unpacked
# into build-gpu/ by the GPU-machine half.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
B=build-gpu
JOBS=${GPU_CHECK_JOBS:-$(nproc)}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$self"; }

RESULTS=gpu-results
case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  "" | --prepare) ;;
  --results)
    [ -n "${2:-}" ] || { echo "gpu-check.sh: --results needs a folder" >&2; exit 2; }
    RESULTS=$2 ;;
  *) echo "gpu-check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac

if [ "${1:-}" = "--prepare" ]; then
  set -e
  # Static libstdc++ / libgcc: this machine's (Debian's) need a newer C library than the GPU
  # machine may have. Test discovery at ctest time: building runs no test binary.
  # FlashInfer's decode (KARAKV_CUDA_ATTENTION=flashinfer): its headers fetched here (the GPU machine
  # has no network), built in when they are there, and carried packed (2 MB) for a rebuild there.
  # Into build-gpu/: the folder CMake's AUTO looks in by default stays as it was, so this changes no
  # other build (the wheel itself is kept with the model, ~/.cache/karakv).
  fi_dir="$PWD/$B/flashinfer"
  bash scripts/fetch_flashinfer.sh "$fi_dir" ||
    echo "gpu-check.sh --prepare: no FlashInfer headers (see above); building without its decode" >&2
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKARAKV_KERNELS_ONLY=ON -DKARAKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DKARAKV_FLASHINFER_DIR="$fi_dir" -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" \
    -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST > /dev/null
  cmake --build "$B" -j "$JOBS" --target kernels_test kernels_bench
  rm -rf "$B/carry" && mkdir -p "$B/carry/lib"
  for bin in "$B/tests/kernels/kernels_test" "$B/bench/kernels/kernels_bench"; do
    # (kernels_test may need none beyond the C library's: its kernels no longer use OpenMP.)
    ldd "$bin" | awk '/=> \//{print $3}' | { grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so' || true; } |
      xargs -r -I{} cp -L {} "$B/carry/lib/"
  done
  # GoogleTest for a rebuild on the GPU machine: its sources, built there with that machine's
  # compiler, and (when the sources are not installed here) the libraries built here, in the
  # layout its CMake package expects.
  if [ -f /usr/src/googletest/CMakeLists.txt ]; then
    cp -r /usr/src/googletest "$B/carry/googletest-src"
  fi
  mkdir -p "$B/carry/gtest/lib/x86_64-linux-gnu/cmake" "$B/carry/gtest/include"
  cp -r /usr/include/gtest /usr/include/gmock "$B/carry/gtest/include/"
  cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a "$B/carry/gtest/lib/x86_64-linux-gnu/"
  cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$B/carry/gtest/lib/x86_64-linux-gnu/cmake/"
  echo "carried libraries: $(find "$B/carry/lib" -maxdepth 1 -type f -printf '%f ')"
  if [ -f "$fi_dir/include/flashinfer/attention/decode.cuh" ]; then
    tar -C "$fi_dir" -cJf "$B/carry/flashinfer-headers.tar.xz" include cccl licenses
  fi

  # The full CUDA build for the device staging test and karakv-bench serve. The same flags as
  # build/ (scripts/setup.sh), so ccache serves what that tree compiled.
  command -v patchelf > /dev/null || { echo "gpu-check.sh --prepare needs patchelf (apt-get install patchelf)" >&2; exit 1; }
  F=build-gpu-full
  cmake -S . -B "$F" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKARAKV_CUDA=ON -DKARAKV_FLASHINFER_DIR="$fi_dir" \
    > /dev/null
  cmake --build "$F" -j "$JOBS" --target karakvd karakv-bench device_staging_test
  C="$B/carry/full"
  rm -rf "$C" && mkdir -p "$C/bin" "$C/server" "$C/lib"
  # karakv-bench finds karakvd at ../server/karakvd from its own folder, as in a build tree.
  strip --strip-debug -o "$C/server/karakvd" "$F/server/karakvd"
  strip --strip-debug -o "$C/bin/karakv-bench" "$F/bench/karakv-bench"
  strip --strip-debug -o "$C/bin/device_staging_test" "$F/tests/integration/device_staging_test"
  for bin in "$C/server/karakvd" "$C/bin/karakv-bench" "$C/bin/device_staging_test"; do
    # Every library it loads (the C library too), not the CUDA driver: that is the GPU machine's.
    ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}' | grep -v '/libcuda\.so' |
      xargs -r -I{} cp -L {} "$C/lib/"
  done
  loader=$(cd "$C/lib" && ls ld-linux-*.so.*)
  for bin in "$C/server/karakvd" "$C/bin/karakv-bench" "$C/bin/device_staging_test"; do
    patchelf --set-interpreter "$C/lib/$loader" --force-rpath --set-rpath '$ORIGIN/../lib' "$bin"
  done
  strip --strip-debug "$C"/lib/lib*.so*  # libkarakv_client is built with debug information
  # They start through the carried loader and libraries here too (the run from the repository root).
  "$C/bin/device_staging_test" --gtest_list_tests > /dev/null
  "$C/server/karakvd" --version > /dev/null
  echo "carried for the full build: $(find "$C/lib" -maxdepth 1 -type f | wc -l) libraries, $(du -sh "$C" | cut -f1)"
  # Packed (about a quarter of the size); the GPU-machine half unpacks it.
  tar -C "$B/carry" -cJf "$B/carry/full.tar.xz" full
  rm -rf "$C"
  tar -C "$B" -cJf "$B/carry/kernels.tar.xz" tests/kernels/kernels_test bench/kernels/kernels_bench
  du -sh "$B/carry" "$B/carry/full.tar.xz" "$B/carry/kernels.tar.xz"
  total=$(du -sk "$B/carry" | cut -f1)
  if [ "$total" -gt $((60 * 1024)) ]; then
    echo "gpu-check.sh --prepare: what to carry is $((total / 1024)) MiB, over the 60 MiB budget" >&2
    exit 1
  fi
  echo "prepared $B ($((total / 1024)) MiB to carry); run scripts/gpu-check.sh on the GPU machine carrying $B/carry"
  exit 0
fi

if ! nvidia-smi -L > /dev/null 2>&1; then
  echo "no device: nvidia-smi finds no GPU here; run this on the GPU machine (scripts/gpu-check.sh --prepare is for here)"
  exit 0
fi
SEQS=${GPU_CHECK_SEQS:-64}
TOKENS=${GPU_CHECK_TOKENS:-8192}
ITERS=${GPU_CHECK_ITERS:-10}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-300}
CARRY_LIB="$PWD/build-gpu/carry/lib"
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
mkdir -p "$RESULTS"
# The steps to run (a rerun after a fix can take only what failed): tests, sanitize, bench, ipc,
# serve, staging (P3 and the serve run with device staging workers), mps (the device-staging rows
# again under NVIDIA's Multi-Process Service), profile (ncu).
STEPS=${GPU_CHECK_STEPS:-tests,sanitize,bench,ipc,serve,staging,mps,profile}
want() { [[ ",$STEPS," == *",$1,"* ]]; }
FULL="$PWD/build-gpu/carry/full"
if [ -f build-gpu/carry/kernels.tar.xz ]; then
  tar -C build-gpu -xJf build-gpu/carry/kernels.tar.xz 2> /dev/null ||
    python3 -m tarfile -e build-gpu/carry/kernels.tar.xz build-gpu
fi
if [ ! -d "$FULL" ] && [ -f build-gpu/carry/full.tar.xz ]; then
  tar -C build-gpu/carry -xJf build-gpu/carry/full.tar.xz 2> /dev/null ||
    python3 -m tarfile -e build-gpu/carry/full.tar.xz build-gpu/carry
fi

# BIN_ENV: the prefix that runs one of $B's binaries: a carried one with the carried libraries on its
# library path, a rebuilt one as it is. Nothing else in this script sees the carried libraries.
set_bin_env() {
  if [ "$B" = build-gpu ]; then
    BIN_ENV=(env "LD_LIBRARY_PATH=$CARRY_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  else
    BIN_ENV=(env)
  fi
}
set_bin_env
run_bin() { "${BIN_ENV[@]}" "$@"; }

# with_timeout SECONDS COMMAND...: the command, killed after SECONDS where timeout(1) exists (exit 124).
with_timeout() {
  local seconds=$1
  shift
  if command -v timeout > /dev/null 2>&1; then timeout -k 10 "$seconds" "$@"; else "$@"; fi
}

# describe_rc STATUS: an exit status in words; above 128 the process was killed by a signal: a crash.
describe_rc() {
  local rc=$1
  if [ "$rc" -eq 0 ]; then
    echo "exit 0"
  elif [ "$rc" -eq 124 ]; then
    echo "exit 124 (timed out)"
  elif [ "$rc" -eq 127 ]; then
    echo "exit 127 (cannot start)"
  elif [ "$rc" -gt 128 ]; then
    local sig=$((rc - 128))
    echo "CRASH: killed by signal $sig (SIG$(kill -l "$sig" 2> /dev/null || echo '?'))"
  else
    echo "exit $rc"
  fi
}

# gtest_counts FILE: "passed failed skipped running" from the output of a gtest run without
# --gtest_brief (one "[ RUN ]" and one result line per test). Each test is counted once, by name:
# the summary at the end lists failed and skipped tests again (and headers such as "[  FAILED  ] 2
# tests, listed below:" are not tests); a test with a FAILED line counts as failed only. `running`
# is the test that started and never finished (a crash or a timeout), or "-".
gtest_counts() {
  awk '
    /^\[ RUN      \] / { running = $4; next }
    match($0, /^\[ +(OK|FAILED|SKIPPED) +\] /) {
      tag = substr($0, 1, RLENGTH); gsub(/[][ ]/, "", tag)
      name = substr($0, RLENGTH + 1); sub(/[ ,].*/, "", name)
      if (name == "" || name ~ /^[0-9]+$/) next
      if (status[name] != "FAILED") status[name] = tag
      if (name == running) running = ""
    }
    END {
      for (n in status) count[status[n]]++
      printf "%d %d %d %s\n", count["OK"], count["FAILED"], count["SKIPPED"], running == "" ? "-" : running
    }
  ' "$1"
}

# The carried build, unless it cannot start here; then rebuild with this machine's nvcc.
cannot_start() {
  local out
  for bin in "$B/tests/kernels/kernels_test" "$B/bench/kernels/kernels_bench"; do
    [ -x "$bin" ] || { echo "$bin is missing"; return 0; }
  done
  if ! out=$(run_bin "$B/tests/kernels/kernels_test" --gtest_list_tests 2>&1); then
    echo "kernels_test does not load: $(printf '%s\n' "$out" | tail -1)"
    return 0
  fi
  out=$(run_bin "$B/bench/kernels/kernels_bench" --help 2>&1)  # prints its usage and exits 2
  case "$out" in
    *"usage: kernels_bench"*) ;;
    *) echo "kernels_bench does not load: $(printf '%s\n' "$out" | tail -1)"; return 0 ;;
  esac
  # Loads; does the driver take the CUDA runtime and kernels it was built with?
  out=$(with_timeout 120 "${BIN_ENV[@]}" "$B/bench/kernels/kernels_bench" --backend=cuda --seqs=1 --tokens=128 \
    --iters=1 2>&1)
  if grep -qE 'cudaError(InsufficientDriver|CompatNotSupportedOnDevice|UnsupportedPtxVersion|NoKernelImageForDevice)' \
    <<< "$out"; then
    echo "the driver refuses the carried build: $(grep -m1 -E 'cudaError' <<< "$out")"
    return 0
  fi
  return 1
}

if why=$(cannot_start); then
  echo "carried build cannot run here: $why; rebuilding with $(nvcc --version | tail -1)"
  rm -rf build-gpu-local
  gtest_dir="$PWD/$B/carry/gtest/lib/x86_64-linux-gnu/cmake/GTest"
  if [ -f "$B/carry/googletest-src/CMakeLists.txt" ]; then
    # GoogleTest built with this machine's compiler: the carried libraries may need a newer C++
    # library than this machine has.
    { cmake -S "$B/carry/googletest-src" -B build-gpu-local/_googletest -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_INSTALL_PREFIX="$PWD/build-gpu-local/_gtest" -DCMAKE_INSTALL_LIBDIR=lib \
        -DCMAKE_POSITION_INDEPENDENT_CODE=ON &&
        cmake --build build-gpu-local/_googletest -j "$JOBS" &&
        cmake --install build-gpu-local/_googletest; } > /tmp/gpu-gtest.txt 2>&1 ||
      { tail -40 /tmp/gpu-gtest.txt; exit 1; }
    gtest_dir="$PWD/build-gpu-local/_gtest/lib/cmake/GTest"
  fi
  fi_flags=(-DKARAKV_FLASHINFER=OFF)
  if [ -f "$B/carry/flashinfer-headers.tar.xz" ]; then
    mkdir -p build-gpu-local/_flashinfer
    tar -C build-gpu-local/_flashinfer -xJf "$B/carry/flashinfer-headers.tar.xz" &&
      fi_flags=(-DKARAKV_FLASHINFER=ON -DKARAKV_FLASHINFER_DIR="$PWD/build-gpu-local/_flashinfer")
  fi
  cmake -S . -B build-gpu-local -G Ninja -DCMAKE_BUILD_TYPE=Release -DKARAKV_KERNELS_ONLY=ON -DKARAKV_CUDA=ON \
    "${fi_flags[@]}" -DGTest_DIR="$gtest_dir" -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST > /tmp/gpu-cmake.txt 2>&1 ||
    { cat /tmp/gpu-cmake.txt; exit 1; }
  cmake --build build-gpu-local -j "$JOBS" --target kernels_test kernels_bench > /tmp/gpu-build.txt 2>&1 ||
    { tail -40 /tmp/gpu-build.txt; exit 1; }
  B=build-gpu-local
  set_bin_env
fi

# The decode tests once more with FlashInfer's decode where it covers the call ("flashinfer" cases:
# the other ops are the same code as "cuda"'s).
FI_TESTS='*/BackendOpsTest.Decode*/flashinfer_*:*/BackendOpsTest.AccumulatorsInBackendMemory/flashinfer_*'
FUSED_TESTS='*/BackendOpsTest.Quantized*/fused_*'  # the fused quantized decode (KARAKV_CUDA_QUANT_DECODE=fused)
# Every op once more with the test thread's waits deferred (issue 39 item 3's stream order).
DEFERRED_TESTS='AllBackends/BackendOpsTest.*/deferred_*'
TEST_FILTER="AllBackends/BackendOpsTest.*/cuda_*:Geometries/BackendOpsTest.*/cuda_*:CudaLimitsTest.*:$FI_TESTS:$FUSED_TESTS"
TEST_FILTER="$TEST_FILTER:$DEFERRED_TESTS"
TEST_FILTER="$TEST_FILTER:CudaAttentionTest.*:FlashInferDecodeTest.*"
if want tests; then
  # 1. Correctness: every op of the cuda backend against the CPU reference (backend_ops_test), and the
  # backend's geometry limits (cuda_limits_test). Not --gtest_brief: it prints no line for a passed or
  # skipped test, and no failed count.
  with_timeout "$TEST_TIMEOUT" "${BIN_ENV[@]}" "$B/tests/kernels/kernels_test" \
    --gtest_filter="${GPU_CHECK_TEST_FILTER:-$TEST_FILTER}" \
    > /tmp/gpu-tests.txt 2>&1
  tests_rc=$?
  read -r passed failed skipped running < <(gtest_counts /tmp/gpu-tests.txt)
  grep -E "Failure|FAILED|Expected|Which is|error" /tmp/gpu-tests.txt | head -60
  tests_status=$(describe_rc "$tests_rc")
  if [ "$running" != "-" ]; then
    tests_status="$tests_status in $running"
    echo "kernels_test ended in $running ($tests_status); its last lines:"
    tail -20 /tmp/gpu-tests.txt
  fi
  # On the GPU machine a test skipped for "no device" is a failure of the check: the backend could not
  # be created.
  no_device=$(grep -m1 '^no device' /tmp/gpu-tests.txt)
  if [ -n "$no_device" ]; then
    tests_status="$tests_status, but the cuda backend could not be created ($no_device)"
    tests_ok=0
  elif [ "$passed" -eq 0 ]; then
    tests_status="$tests_status, but no test passed"
    tests_ok=0
  elif [ -z "${GPU_CHECK_TEST_FILTER:-}" ] && ! grep -qE '^\[ +OK \] .*Quantized.*/fused_' /tmp/gpu-tests.txt; then
    # The fused quantized decode's tests must have run, not been skipped by their own filter.
    tests_status="$tests_status, but no fused quantized test passed"
    tests_ok=0
  else
    tests_ok=1
  fi
else
  tests_rc=0 tests_ok=1 passed=- failed=- skipped=- tests_status="skipped (GPU_CHECK_STEPS)"
fi

MEMCHECK_FILTER='AllBackends/BackendOpsTest.*/cuda_fp16:Geometries/BackendOpsTest.*/cuda_fp16_hd96_g1'
MEMCHECK_FILTER="$MEMCHECK_FILTER:AllBackends/BackendOpsTest.DecodeAttention/flashinfer_fp16"
MEMCHECK_FILTER="$MEMCHECK_FILTER:Geometries/BackendOpsTest.DecodeAttention/flashinfer_fp16_hd256_g2"
MEMCHECK_FILTER="$MEMCHECK_FILTER:AllBackends/BackendOpsTest.QuantizedAttention/fused_fp16"
MEMCHECK_FILTER="$MEMCHECK_FILTER:Geometries/BackendOpsTest.QuantizedAttention/fused_fp16_hd256_g2"
ATTENTION_FILTER='AllBackends/BackendOpsTest.DecodeAttention/cuda_fp16:AllBackends/BackendOpsTest.CausalAttention/cuda_fp16'
ATTENTION_FILTER="$ATTENTION_FILTER:Geometries/BackendOpsTest.*Attention/cuda_fp16_hd256_g2"
ATTENTION_FILTER="$ATTENTION_FILTER:Geometries/BackendOpsTest.*Attention/cuda_fp16_hd64_g8"
# The fused quantized decode stages records and logits in shared memory: races there are its risk.
# One geometry (a group of 12: a full pass and a partial one), every format, within the timeouts.
ATTENTION_FILTER="$ATTENTION_FILTER:FusedGeometries/BackendOpsTest.QuantizedAttention/fused_fp16_hd64_g12"
if want sanitize; then
  # 1b. One dtype's ops under compute-sanitizer: memcheck (out-of-bounds and misaligned device
  # accesses, errors of CUDA calls) over the default geometry and the generic head_dim layout, fp16;
  # synccheck (warp masks, barriers) and racecheck (shared memory) over the attention kernels.
  sanitizer=$(command -v compute-sanitizer || ls "$(dirname "$(command -v nvcc)")/compute-sanitizer" \
    /usr/local/cuda/bin/compute-sanitizer 2> /dev/null | head -1)
  sanitizer_rc=0
  declare -A sanitized
  # sanitize TOOL FILTER SECONDS: sanitized[TOOL] says how it went; sanitizer_rc is 1 after any failure.
  sanitize() {
    local tool=$1 filter=$2 seconds=$3 rc passed failed skipped running errors
    if [ -z "$sanitizer" ]; then
      sanitized[$tool]="not run: compute-sanitizer not found next to nvcc"
      return
    fi
    with_timeout "$seconds" "${BIN_ENV[@]}" "$sanitizer" --tool "$tool" --error-exitcode 86 --print-limit 20 \
      "$B/tests/kernels/kernels_test" --gtest_filter="$filter" > "/tmp/gpu-$tool.txt" 2>&1
    rc=$?
    read -r passed failed skipped running < <(gtest_counts "/tmp/gpu-$tool.txt")
    errors=$(grep -m1 -oE 'ERROR SUMMARY: [0-9]+' "/tmp/gpu-$tool.txt" | grep -oE '[0-9]+$')
    sanitized[$tool]="$(describe_rc "$rc"); ${errors:-no} $tool errors; tests $passed / $failed / $skipped"
    [ "$running" = "-" ] || sanitized[$tool]="${sanitized[$tool]}, ended in $running"
    if [ "$rc" -ne 0 ]; then
      sanitizer_rc=1
      echo "$tool (${sanitized[$tool]}):"
      grep -m40 -E '^=========' "/tmp/gpu-$tool.txt"
    fi
  }
  sanitize memcheck "$MEMCHECK_FILTER" "${GPU_CHECK_MEMCHECK_TIMEOUT:-120}"
  sanitize synccheck "$ATTENTION_FILTER" 60
  sanitize racecheck "$ATTENTION_FILTER" 90
else
  sanitizer_rc=0
  declare -A sanitized=([memcheck]="skipped (GPU_CHECK_STEPS)" [synccheck]=skipped [racecheck]=skipped)
fi

QUANT_FORMATS=kivi2,kivi4,tq2,tq3,tq4
# route_rows PREFIX STATUS_KEY LABEL FLAGS...: kernels_bench for $model with FLAGS, its exit status in
# status[$model.STATUS_KEY], its rows in r[$model.PREFIX_<row>].
route_rows() {
  local prefix=$1 key=$2 label=$3 rc name value
  shift 3
  with_timeout 240 "${BIN_ENV[@]}" "$B/bench/kernels/kernels_bench" --backend=cuda --model=$model --seqs="$SEQS" \
    --tokens="$TOKENS" --iters="$ITERS" "$@" > /tmp/gpu-bench-$prefix-$model.txt 2>&1
  rc=$?
  status[$model.$key]=$(describe_rc "$rc")
  [ "$rc" -eq 0 ] || { echo "kernels_bench $model $label (${status[$model.$key]}):"; tail -5 /tmp/gpu-bench-$prefix-$model.txt; }
  while read -r name value _; do
    case "$name" in \#* | "") continue ;; esac
    r[$model.${prefix}_$name]=$value
  done < /tmp/gpu-bench-$prefix-$model.txt
}
if want bench; then
  # 2. Benchmarks, both geometries, and PyTorch SDPA on the same problem; decode straight from each
  # quantized format against the fp16 decode over the same tokens (time and output error).
  declare -A r status
  for model in smollm2 llama8b; do
    with_timeout 240 "${BIN_ENV[@]}" "$B/bench/kernels/kernels_bench" --backend=cuda --model=$model --seqs="$SEQS" \
      --tokens="$TOKENS" --iters="$ITERS" --quant="$QUANT_FORMATS" > /tmp/gpu-bench-$model.txt 2>&1
    rc=$?
    status[$model.kernels_bench]=$(describe_rc "$rc")
    [ "$rc" -eq 0 ] || { echo "kernels_bench $model failed (${status[$model.kernels_bench]}):"; tail -5 /tmp/gpu-bench-$model.txt; }
    with_timeout 180 python3 bench/kernels/sdpa_bench.py --model=$model --seqs="$SEQS" --tokens="$TOKENS" \
      > /tmp/gpu-sdpa-$model.txt 2>&1
    rc=$?
    status[$model.sdpa_bench]=$(describe_rc "$rc")
    [ "$rc" -eq 0 ] || { echo "sdpa_bench $model failed (${status[$model.sdpa_bench]}):"; tail -5 /tmp/gpu-sdpa-$model.txt; }
    while read -r name value _; do
      case "$name" in \#* | "") continue ;; esac
      r[$model.$name]=$value
    done < <(cat /tmp/gpu-bench-$model.txt /tmp/gpu-sdpa-$model.txt)
    head -1 /tmp/gpu-bench-$model.txt
    # The same fp16 decode through FlashInfer's batch decode (its rows prefixed fi_), and the
    # quantized decode through the fused kernels (rows prefixed fq_; its fp16 rows are the first
    # run's kernels measured again beside it).
    route_rows fi flashinfer_bench "with FlashInfer" --attention=flashinfer
    route_rows fq fused_bench "with the fused quantized decode" --quant_decode=fused --quant="$QUANT_FORMATS"
  done
  head -1 /tmp/gpu-sdpa-llama8b.txt
else
  declare -A r status=([smollm2.kernels_bench]=skipped [llama8b.kernels_bench]=skipped [smollm2.sdpa_bench]=skipped
    [llama8b.sdpa_bench]=skipped [smollm2.flashinfer_bench]=skipped [llama8b.flashinfer_bench]=skipped
    [smollm2.fused_bench]=skipped [llama8b.fused_bench]=skipped)
fi

if want ipc; then
  # 3. Device staging (CUDA IPC) between two processes: this test is the worker, the carried karakvd
  # (--backend=cuda) the daemon. A "no device" skip on the GPU machine fails the check.
  with_timeout 300 env KARAKV_TEST_KARAKVD="$FULL/server/karakvd" "$FULL/bin/device_staging_test" \
    --gtest_output="xml:$RESULTS/device_staging_test.xml" > /tmp/gpu-ipc.txt 2>&1
  ipc_rc=$?
  read -r ipc_passed ipc_failed ipc_skipped ipc_running < <(gtest_counts /tmp/gpu-ipc.txt)
  ipc_status=$(describe_rc "$ipc_rc")
  [ "$ipc_running" = "-" ] || ipc_status="$ipc_status in $ipc_running"
  if grep -q '^no device' /tmp/gpu-ipc.txt; then
    ipc_status="$ipc_status, but skipped for: $(grep -m1 '^no device' /tmp/gpu-ipc.txt)"
    ipc_rc=1
  fi
  [ "$ipc_rc" -eq 0 ] || { echo "device_staging_test ($ipc_status):"; tail -30 /tmp/gpu-ipc.txt; }
else
  ipc_rc=0 ipc_passed=- ipc_failed=- ipc_skipped=- ipc_status="skipped (GPU_CHECK_STEPS)"
fi

SERVE_STEPS=${GPU_CHECK_SERVE_STEPS:-300}
SERVE_SECONDS=${GPU_CHECK_SERVE_SECONDS:-20}
SERVE_BATCHES=${GPU_CHECK_SERVE_BATCHES:-64,256}
SERVE_POLICIES=${GPU_CHECK_SERVE_POLICIES:-none,snapkv,kara}
SERVE_RUNS=$(( $(tr ',' '\n' <<< "$SERVE_BATCHES" | grep -c .) * $(tr ',' '\n' <<< "$SERVE_POLICIES" | grep -c .) ))
declare -A serve
if want serve; then
  # 4. karakv-bench serve on the GPU: none, snapkv, kara at max batch 64 and 256, karakvd --backend=cuda.
  with_timeout $((SERVE_SECONDS * SERVE_RUNS + 120)) "$FULL/bin/karakv-bench" serve --karakvd_flags=--backend=cuda \
    --serve_policies="$SERVE_POLICIES" --serve_batches="$SERVE_BATCHES" --serve_steps="$SERVE_STEPS" \
    --serve_seconds="$SERVE_SECONDS" --out_dir="$RESULTS/serve" > /tmp/gpu-serve.txt 2>&1
  serve_rc=$?
  serve_status=$(describe_rc "$serve_rc")
  [ "$serve_rc" -eq 0 ] || { echo "karakv-bench serve failed ($serve_status):"; tail -20 /tmp/gpu-serve.txt; }
  # policy,max_batch -> "tok/s; TPOT mean ms; compaction s" from serve_runs.csv
  if [ -f "$RESULTS/serve/serve_runs.csv" ]; then
    while IFS=, read -r policy batch value; do serve[$policy.$batch]=$value; done < <(python3 - "$RESULTS/serve/serve_runs.csv" <<'PY'
import csv, sys
for row in csv.DictReader(open(sys.argv[1])):
    print(f"{row['policy']},{row['max_batch']},{float(row['throughput_tok_s']):.0f}; {float(row['tpot_mean_ms']):.2f}; "
          f"{float(row['compaction_s']):.2f}")
PY
  )
  fi
else
  serve_rc=0 serve_status="skipped (GPU_CHECK_STEPS)"
fi

declare -A p3
# p3_run KIND TAG: karakv-bench p3 through KIND staging (device, device-ring, shm, device-idle,
# device-ordered, device-ring-ordered: stream-ordered by CUDA events) into p3[TAG]: "Step p50 .. us,
# Ping p50 .. us, ..x (PASS|FAIL)" (ordered: and the Step until its output is read back), or the
# failure; p3_failed=1 after one.
p3_run() {
  local st=$1 tag=$2 rc
  local ring_flag=--p3_fast_path=false write_every=--p3_write_every=1 ordered=--p3_stream_ordered=false
  [[ $st == device-ring* ]] && ring_flag=--p3_fast_path=true
  [ "$st" = device-idle ] && write_every=--p3_write_every=1000000
  [[ $st == *-ordered ]] && ordered=--p3_stream_ordered=true
  with_timeout 120 "$FULL/bin/karakv-bench" p3 --karakvd_flags=--backend=cuda --p3_staging="${st%%-*}" \
    "$ring_flag" "$write_every" "$ordered" --csv > /tmp/gpu-p3-$tag.txt 2> /tmp/gpu-p3-$tag.log
  rc=$?
  p3[$tag]="$(describe_rc "$rc")"
  if [ "$rc" -eq 0 ]; then
    p3[$tag]=$(python3 - /tmp/gpu-p3-$tag.txt <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) >= 7 and r[0] == "P3"]
p50 = rows[0]
ready = [r for r in rows if r[1].startswith("Step until its output")]
extra = f"; until read back {float(ready[0][2]):.0f} us, {float(ready[0][6]):.2f}x" if ready else ""
print(f"Step p50 {float(p50[2]):.0f} us, Ping p50 {float(p50[4]):.0f} us, {float(p50[6]):.2f}x ({p50[8]}){extra}")
PY
    )
  else
    echo "karakv-bench p3 --p3_staging=$st ($tag) failed (${p3[$tag]}):"; tail -5 /tmp/gpu-p3-$tag.log
    # Under MPS a failure is a row of the table, not a failure of the check (the product runs
    # without MPS; what MPS changes is reported, not required).
    [[ $tag == mps-* ]] || p3_failed=1
  fi
}
# serve_device_run DIR [ORDERED]: one serve run of kara at max batch 256 whose workers use device
# staging (ORDERED=true: stream-ordered by CUDA events); sets serve_device_rc and serve_device
# ("exit 0; N tok/s; TPOT M ms").
serve_device_run() {
  local dir=$1 ordered=${2:-false}
  with_timeout $((SERVE_SECONDS + 120)) "$FULL/bin/karakv-bench" serve --karakvd_flags=--backend=cuda \
    --serve_staging=device --serve_stream_ordered="$ordered" --serve_policies=kara --serve_batches=256 --serve_steps="$SERVE_STEPS" \
    --serve_seconds="$SERVE_SECONDS" --out_dir="$dir" > "/tmp/gpu-$(basename "$dir").txt" 2>&1
  serve_device_rc=$?
  serve_device="$(describe_rc "$serve_device_rc")"
  if [ -f "$dir/serve_runs.csv" ]; then
    serve_device="$serve_device; $(python3 - "$dir/serve_runs.csv" <<'PY'
import csv, sys
for row in csv.DictReader(open(sys.argv[1])):
    print(f"{float(row['throughput_tok_s']):.0f} tok/s; TPOT {float(row['tpot_mean_ms']):.2f} ms")
PY
    )"
  fi
  [ "$serve_device_rc" -eq 0 ] || { echo "karakv-bench serve with device staging ($dir) failed:"; tail -20 "/tmp/gpu-$(basename "$dir").txt"; }
}

if want staging; then
  # 5. A one-token Step through device staging (CUDA IPC) against an empty gRPC Ping on the same
  # karakvd --backend=cuda (target p50 <= 1x), by gRPC and through the fast path's ring, shm staging
  # on the same daemon for comparison; and one serve run whose workers use device staging.
  # device-idle: the worker writes its staging once, not before every Step, so no copy of its own
  # reaches the GPU between Steps (what the worker's GPU work costs the daemon's Step).
  # device-ordered, device-ring-ordered: the same Step stream-ordered by CUDA events (issue 39 item 3),
  # and the serve run once more that way.
  for st in device device-ring shm device-idle device-ordered device-ring-ordered; do p3_run "$st" "$st"; done
  serve_device_run "$RESULTS/serve-device-ordered" true
  serve_device_ordered=$serve_device serve_device_ordered_rc=$serve_device_rc
  serve_device_run "$RESULTS/serve-device"
  [ "$serve_device_ordered_rc" -eq 0 ] || serve_device_rc=$serve_device_ordered_rc
else
  p3=([device]="skipped (GPU_CHECK_STEPS)" [device-ring]=skipped [shm]=skipped [device-idle]=skipped)
  serve_device_rc=0 serve_device="skipped (GPU_CHECK_STEPS)" serve_device_ordered="skipped (GPU_CHECK_STEPS)"
fi

if want mps; then
  # 5b. NVIDIA's Multi-Process Service: without it the kernels of two processes on one GPU (the
  # worker and karakvd) take turns; with it they run together. Where nvidia-cuda-mps-control exists,
  # its control daemon starts with pipe and log directories of this check's own (nothing about the
  # GPU is changed: no compute mode, no clocks), the device-staging Step and serve run are repeated
  # under it, and it is told to quit, on any exit too.
  mps_control=$(command -v nvidia-cuda-mps-control || ls /usr/local/cuda/bin/nvidia-cuda-mps-control 2> /dev/null | head -1)
  saved_serve_device=$serve_device saved_serve_device_rc=$serve_device_rc
  if [ -z "$mps_control" ]; then
    mps_status="not run: nvidia-cuda-mps-control not found"
  else
    CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/karakv-mps-pipe.XXXXXX)
    CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/karakv-mps-log.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    if "$mps_control" -d > /tmp/gpu-mps-start.txt 2>&1; then
      trap 'echo quit | "$mps_control" > /dev/null 2>&1' EXIT
      p3_run device mps-device
      p3_run device-ring mps-device-ring
      serve_device_run "$RESULTS/serve-device-mps"
      echo quit | "$mps_control" > /dev/null 2>&1
      trap - EXIT
      sleep 1
      # The server's log names each client it took (the control daemon's, each server it started):
      # none means the processes did not go through MPS.
      mps_clients=$(cat "$CUDA_MPS_LOG_DIRECTORY"/server.log 2> /dev/null | grep -ci 'client')
      mps_servers=$(cat "$CUDA_MPS_LOG_DIRECTORY"/control.log 2> /dev/null | grep -ci 'new server')
      mps_status="MPS log: ${mps_servers:-0} server start(s), ${mps_clients:-0} client line(s); serve: $serve_device"
      rm -rf "$RESULTS/mps-log"
      cp -r "$CUDA_MPS_LOG_DIRECTORY" "$RESULTS/mps-log" 2> /dev/null
    else
      mps_status="not run: nvidia-cuda-mps-control -d failed: $(tail -1 /tmp/gpu-mps-start.txt)"
    fi
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
  serve_device=$saved_serve_device serve_device_rc=$saved_serve_device_rc
else
  mps_status="skipped (GPU_CHECK_STEPS)"
fi

declare -A deploy
DEPLOY_POLICIES=${GPU_CHECK_DEPLOY_POLICIES:-none,snapkv,kara}
DEPLOY_BATCH=${GPU_CHECK_DEPLOY_BATCH:-64}
DEPLOY_STEPS=${GPU_CHECK_DEPLOY_STEPS:-6000}
DEPLOY_SECONDS=${GPU_CHECK_DEPLOY_SECONDS:-120}
DEPLOY_POOL=${GPU_CHECK_DEPLOY_POOL:-16GiB}
DEPLOY_ORDERED=${GPU_CHECK_DEPLOY_ORDERED:-false}  # true: workers stream-ordered by CUDA events (issue 39 item 3)
if want deploy; then
  # 6b. Issue 39 item 5 (not in the default steps: about DEPLOY_SECONDS per policy): the serve run that
  # looks like a deployment: Llama-3.1-8B's geometry (32 layers, 32/8 heads, head_dim 128, bf16),
  # workers on device staging whose own projections and MLP run on the same GPU with cuBLAS
  # (--serve_worker_compute=gemm), outputs of 4-8k tokens, a pool small enough that none preempts.
  # One worker: one model instance runs the whole batch (four would read the weights four times).
  # cuBLAS is the machine's: a CUDA toolkit's, or PyTorch's nvidia-cublas wheel.
  cublas_libs=$(python3 - <<'PY' 2> /dev/null
import glob, os
dirs = ["/usr/local/cuda/lib64"]
for mod in ("nvidia.cublas", "nvidia.cu13", "torch"):  # CUDA 12 wheels; CUDA 13 wheels; torch's own
    try:
        m = __import__(mod, fromlist=["_"])
        for p in list(getattr(m, "__path__", [])) or [os.path.dirname(m.__file__)]:
            dirs.append(os.path.join(p, "lib"))
    except Exception:
        pass
found = []
for soname in ("libcublas.so.13", "libcublas.so.12"):
    for d in dirs:
        found += glob.glob(os.path.join(d, soname))
print(":".join(dict.fromkeys(found)))
PY
  )
  deploy[cublas]=${cublas_libs:-"none found (the workers will say so)"}
  rm -rf "$RESULTS/deploy"  # a failed rerun must not report the last run's numbers
  deploy_runs=$(tr ',' '\n' <<< "$DEPLOY_POLICIES" | grep -c .)
  # The GPU's utilization (NVML: the share of each sample period in which a kernel ran) every
  # 200 ms while the runs go, read only: issue 39 wants the GPU idle <= 10% of a decode step.
  util_pid=
  if command -v nvidia-smi > /dev/null; then
    # GPU 0: karakvd's (--cuda_device 0) and the workers'.
    nvidia-smi -i 0 --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200 \
      > "$RESULTS/deploy-utilization.txt" 2> /dev/null &
    util_pid=$!
    trap 'kill "$util_pid" 2> /dev/null' EXIT  # an interrupted check must not leave it sampling
  fi
  with_timeout $((DEPLOY_SECONDS * deploy_runs + 180)) "$FULL/bin/karakv-bench" serve --karakvd_flags=--backend=cuda \
    --serve_stream_ordered="$DEPLOY_ORDERED" \
    --serve_staging=device --serve_worker_compute=gemm ${cublas_libs:+--serve_cublas="$cublas_libs"} --serve_workers=1 \
    --serve_layers=32 --serve_q_heads=32 --serve_kv_heads=8 --serve_head_dim=128 --serve_dtype=bf16 \
    --serve_pool_bytes="$DEPLOY_POOL" --serve_prompt=100-500 --serve_output=4000-8000 \
    --serve_policies="$DEPLOY_POLICIES" --serve_batches="$DEPLOY_BATCH" --serve_steps="$DEPLOY_STEPS" \
    --serve_seconds="$DEPLOY_SECONDS" --out_dir="$RESULTS/deploy" > /tmp/gpu-deploy.txt 2>&1
  rc=$?
  if [ -n "$util_pid" ]; then
    kill "$util_pid" 2> /dev/null
    wait "$util_pid" 2> /dev/null
    trap - EXIT
  fi
  deploy[status]=$(describe_rc "$rc")
  [ "$DEPLOY_ORDERED" = true ] && deploy[status]="${deploy[status]}, stream-ordered workers"
  deploy[utilization]=$(python3 - "$RESULTS/deploy-utilization.txt" <<'PY' 2> /dev/null
import statistics, sys
v = [float(x) for x in open(sys.argv[1]) if x.strip().replace(".", "").isdigit()]
# Every sample of the step, the daemons' starts and the prefills between runs included.
print(f"mean {statistics.mean(v):.0f}% over {len(v)} samples (200 ms); median {statistics.median(v):.0f}%; "
      f"{100 * sum(x >= 90 for x in v) / len(v):.0f}% of samples at >= 90%" if v else "no samples")
PY
  )
  [ "$rc" -eq 0 ] || { echo "karakv-bench serve, deployment geometry (${deploy[status]}):"; tail -20 /tmp/gpu-deploy.txt; }
  if [ -f "$RESULTS/deploy/serve_runs.csv" ]; then
    while IFS=, read -r policy value; do deploy[$policy]=$value; done < <(python3 - "$RESULTS/deploy/serve_runs.csv" <<'PY'
import csv, sys
rows = {r["policy"]: r for r in csv.DictReader(open(sys.argv[1]))}
for p, r in rows.items():
    print(f"{p},{float(r['throughput_tok_s']):.0f} tok/s; TPOT {float(r['tpot_mean_ms']):.1f} ms; "
          f"{r['preemptions']} preemptions; peak KV {float(r['peak_kv_mib']):.0f} MiB; {r['steps']} steps")
tok = {p: float(r["throughput_tok_s"]) for p, r in rows.items()}
if tok.get("kara") and tok.get("none"):
    print(f"kara/none,{tok['kara'] / tok['none']:.2f}x (target >= 1.5)")
if tok.get("kara") and tok.get("snapkv"):
    print(f"kara/snapkv,{tok['kara'] / tok['snapkv']:.2f}x (target >= 1.2)")
PY
    )
  fi
else
  deploy[status]="skipped (not in GPU_CHECK_STEPS; GPU_CHECK_STEPS=deploy runs it)"
fi

profile_rows=()
if want profile; then
  # 6. Nsight Compute over the kernels the targets miss on: the fp16 paged decode (partial_kernel)
  # and the quantized decode's logits, softmax and values kernels (kivi4), a few launches each, at
  # SmolLM2's geometry. --clock-control none: the GPU's clocks stay as they are. The raw CSV goes to
  # the results folder; the table takes time, DRAM and SM throughput, warps active and registers.
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
  if [ -z "$NCU" ]; then
    profile_rows+=("ncu: not found on this machine (no profile)")
  else
    NCU_METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    NCU_METRICS=$NCU_METRICS,sm__throughput.avg.pct_of_peak_sustained_elapsed
    NCU_METRICS=$NCU_METRICS,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
    for what in decode:partial_kernel:2 quant:'quant_(logits|softmax|values)_kernel':3 \
                fused:'quant_fused_(kernel|combine_kernel)':2 flashinfer:BatchDecodeWithPagedKVCacheKernel:2; do
      IFS=: read -r tag regex count <<< "$what"
      quant_flag=()
      [ "$tag" = quant ] && quant_flag=(--quant=kivi4)
      [ "$tag" = fused ] && quant_flag=(--quant=kivi4 --quant_decode=fused)
      attention=own
      [ "$tag" = flashinfer ] && attention=flashinfer
      with_timeout 120 "${BIN_ENV[@]}" "$NCU" --clock-control none --csv --page raw --metrics "$NCU_METRICS" \
        -k "regex:$regex" -c "$count" "$B/bench/kernels/kernels_bench" --backend=cuda --attention=$attention --model=smollm2 \
        --seqs="$SEQS" --tokens="$TOKENS" --iters=1 ${quant_flag[@]+"${quant_flag[@]}"} > /tmp/gpu-ncu-$tag.csv 2> /tmp/gpu-ncu-$tag.log
      rc=$?
      if [ "$rc" -ne 0 ]; then
        profile_rows+=("ncu $tag: $(describe_rc "$rc"): $(cat /tmp/gpu-ncu-$tag.log /tmp/gpu-ncu-$tag.csv | grep -m1 -E 'ERR|rror' | cut -c1-160)")
        continue
      fi
      while IFS= read -r line; do profile_rows+=("$line"); done < <(python3 - /tmp/gpu-ncu-$tag.csv <<'PY'
import csv, re, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.reader(lines))
if len(rows) < 3:
    print("ncu: no kernel profiled (see the CSV)")
    sys.exit(0)
head, units = rows[0], rows[1]
name_col = next((head.index(c) for c in ("Kernel Name", "Function Name", "Demangled Name") if c in head), None)
def value(row, metric):
    return row[head.index(metric)] if metric in head else "?"
for row in rows[2:]:
    found = re.search(r"(\w+_kernel|BatchDecodeWithPagedKVCacheKernel)\b", row[name_col]) if name_col is not None else None
    name = found.group(1) if found else (row[name_col][:60] if name_col is not None else "?")
    t = value(row, "gpu__time_duration.sum")
    t_unit = units[head.index("gpu__time_duration.sum")] if "gpu__time_duration.sum" in head else ""
    print(f"ncu {name}: time {t} {t_unit}; DRAM {value(row, 'dram__throughput.avg.pct_of_peak_sustained_elapsed')}% of peak; "
          f"SM {value(row, 'sm__throughput.avg.pct_of_peak_sustained_elapsed')}%; "
          f"warps active {value(row, 'sm__warps_active.avg.pct_of_peak_sustained_active')}%; "
          f"{value(row, 'launch__registers_per_thread')} registers")
PY
      )
    done
  fi
else
  profile_rows+=("ncu profile: skipped (GPU_CHECK_STEPS)")
fi

cp /tmp/gpu-deploy.txt /tmp/gpu-mps-start.txt /tmp/gpu-bench-fi-*.txt /tmp/gpu-tests.txt /tmp/gpu-memcheck.txt /tmp/gpu-synccheck.txt /tmp/gpu-racecheck.txt /tmp/gpu-p3-*.txt /tmp/gpu-p3-*.log /tmp/gpu-serve-device.txt /tmp/gpu-serve-device-ordered.txt /tmp/gpu-serve-device-mps.txt /tmp/gpu-bench-*.txt /tmp/gpu-sdpa-*.txt /tmp/gpu-ipc.txt /tmp/gpu-serve.txt /tmp/gpu-ncu-* "$RESULTS/" 2> /dev/null

ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(a)/float(b):.2f}' if a and b else 'n/a')" "${1:-}" "${2:-}"; }
echo
echo "| check | smollm2-135m | llama-3.1-8b |"
echo "| --- | --- | --- |"
echo "| cuda ops vs CPU reference (tests passed / failed / skipped; exit status) | $passed / $failed / $skipped; $tests_status | (same run) |"
echo "| cuda ops under compute-sanitizer memcheck (fp16, $MEMCHECK_FILTER) | ${sanitized[memcheck]} | (same run) |"
echo "| attention under synccheck / racecheck (fp16; head_dim 64 g3, 256 g2, 64 g8) | ${sanitized[synccheck]} / ${sanitized[racecheck]} | (same run) |"
fi_built="not known (the test step did not run)"
if want tests; then
  fi_built="not shown (no flashinfer test passed)"
  grep -qE '^\[ +OK \] .*/flashinfer_' /tmp/gpu-tests.txt && fi_built=yes
  grep -q '^not built: ' /tmp/gpu-tests.txt && fi_built="no ($(grep -m1 '^not built: ' /tmp/gpu-tests.txt))"
fi
echo "| FlashInfer's decode in this build (the flashinfer test cases and fi_ rows) | $fi_built | (same build) |"
echo "| kernels_bench exit status (own decode; with FlashInfer's) | ${status[smollm2.kernels_bench]}; ${status[smollm2.flashinfer_bench]} | ${status[llama8b.kernels_bench]}; ${status[llama8b.flashinfer_bench]} |"
echo "| sdpa_bench exit status | ${status[smollm2.sdpa_bench]} | ${status[llama8b.sdpa_bench]} |"
for m in decode_layer_us decode_step_ms decode_bandwidth copy_bandwidth decode_vs_copy sdpa_layer_us sdpa_bandwidth \
         sdpa_layer_sync_us kara_tick_ms kara_tick_vs_decode_step; do
  echo "| $m | ${r[smollm2.$m]:-n/a} | ${r[llama8b.$m]:-n/a} |"
done
for f in ${QUANT_FORMATS//,/ }; do
  echo "| quantized decode $f: time / fp16 decode; mean rel err | ${r[smollm2.quant_${f}_vs_fp16]:-n/a}; ${r[smollm2.quant_${f}_rel_err]:-n/a} | ${r[llama8b.quant_${f}_vs_fp16]:-n/a}; ${r[llama8b.quant_${f}_rel_err]:-n/a} |"
done
for f in ${QUANT_FORMATS//,/ }; do
  echo "| fused quantized decode $f: time / fp16 decode; mean rel err | ${r[smollm2.fq_quant_${f}_vs_fp16]:-n/a}; ${r[smollm2.fq_quant_${f}_rel_err]:-n/a} | ${r[llama8b.fq_quant_${f}_vs_fp16]:-n/a}; ${r[llama8b.fq_quant_${f}_rel_err]:-n/a} |"
done
echo "| kernels_bench exit status, fused quantized decode | ${status[smollm2.fused_bench]} | ${status[llama8b.fused_bench]} |"
for m in decode_layer_us decode_bandwidth decode_vs_copy; do
  echo "| FlashInfer $m | ${r[smollm2.fi_$m]:-n/a} | ${r[llama8b.fi_$m]:-n/a} |"
done
echo "| FlashInfer decode time / own decode time | $(ratio "${r[smollm2.fi_decode_layer_us]:-}" "${r[smollm2.decode_layer_us]:-}") | $(ratio "${r[llama8b.fi_decode_layer_us]:-}" "${r[llama8b.decode_layer_us]:-}") |"
echo "| FlashInfer decode time / sdpa time (target <= 1.00) | $(ratio "${r[smollm2.fi_decode_layer_us]:-}" "${r[smollm2.sdpa_layer_us]:-}") | $(ratio "${r[llama8b.fi_decode_layer_us]:-}" "${r[llama8b.sdpa_layer_us]:-}") |"
echo "| paged decode time / sdpa time | $(ratio "${r[smollm2.decode_layer_us]:-}" "${r[smollm2.sdpa_layer_us]:-}") | $(ratio "${r[llama8b.decode_layer_us]:-}" "${r[llama8b.sdpa_layer_us]:-}") |"
echo "| paged decode time / sdpa time, both synchronized per call | $(ratio "${r[smollm2.decode_layer_us]:-}" "${r[smollm2.sdpa_layer_sync_us]:-}") | $(ratio "${r[llama8b.decode_layer_us]:-}" "${r[llama8b.sdpa_layer_sync_us]:-}") |"
echo "| device staging, two processes (device_staging_test passed / failed / skipped; exit status) | $ipc_passed / $ipc_failed / $ipc_skipped; $ipc_status | (same run) |"
echo "| karakv-bench serve on the GPU (exit status) | $serve_status | (serve geometry: 4 layers, Hq 4, Hk 2, D 64, fp16) |"
for policy in ${SERVE_POLICIES//,/ }; do
  for batch in ${SERVE_BATCHES//,/ }; do
    echo "| serve $policy, max batch $batch: tok/s; TPOT mean ms; compaction s | ${serve[$policy.$batch]:-n/a} | - |"
  done
done
echo "| Step via device staging vs Ping, same karakvd (target <= 1x) | ${p3[device]:-n/a} | - |"
echo "| Step via device staging through the ring vs Ping (target <= 1x) | ${p3[device-ring]:-n/a} | - |"
echo "| Step via device staging, staging written once (no worker copies between Steps) vs Ping | ${p3[device-idle]:-n/a} | - |"
echo "| Step via shm staging vs Ping, same karakvd (for comparison) | ${p3[shm]:-n/a} | - |"
echo "| Step via device staging, stream-ordered by CUDA events, vs Ping; through the ring | ${p3[device-ordered]:-n/a}; ${p3[device-ring-ordered]:-n/a} | - |"
for row in ${profile_rows[@]+"${profile_rows[@]}"}; do echo "| profile (SmolLM2 geometry, $SEQS x $TOKENS tokens) | $row | - |"; done
echo "| serve kara, max batch 256, workers on device staging | $serve_device | - |"
echo "| the same, stream-ordered by CUDA events | ${serve_device_ordered:-n/a} | - |"
echo "| under MPS: Step via device staging vs Ping; through the ring | ${p3[mps-device]:-n/a}; ${p3[mps-device-ring]:-n/a} | - |"
echo "| under MPS: serve kara, max batch 256, device staging | $mps_status | - |"
echo "| deployment serve (Llama-3.1-8B geometry, cuBLAS workers, max batch $DEPLOY_BATCH, pool $DEPLOY_POOL): exit status | ${deploy[status]} | cuBLAS: ${deploy[cublas]:-n/a} |"
for policy in ${DEPLOY_POLICIES//,/ } kara/none kara/snapkv; do
  [ -n "${deploy[$policy]:-}" ] && echo "| deployment serve $policy | - | ${deploy[$policy]} |"
done
[ -n "${deploy[utilization]:-}" ] && echo "| deployment serve: GPU utilization (target: idle <= 10%) | ${deploy[utilization]} | - |"
echo "($SEQS sequences x $TOKENS tokens, fp16; targets: decode_vs_copy >= 0.70, paged/sdpa <= 1.00; build: $B;"
echo " serve: $SERVE_STEPS steps or $SERVE_SECONDS s per run; every output in $RESULTS/)"

# Issue 39's kernel targets as karakv-bench's CSV columns, one row per target and model, into
# $RESULTS/targets.csv (for bench/results/gpu/): fp16 decode against a device copy and against
# PyTorch SDPA on the same bytes (own kernels and FlashInfer's), quantized decode time against fp16
# decode. A value the run did not produce is empty, its result "n/a".
for key in "${!r[@]}"; do echo "$key ${r[$key]}"; done > /tmp/gpu-values.txt
python3 - /tmp/gpu-values.txt "$RESULTS/targets.csv" <<'PY'
import csv, sys
values = {}
for line in open(sys.argv[1]):
    key, _, value = line.strip().partition(" ")
    try:
        values[key] = float(value)
    except ValueError:
        pass
rows = []
def row(mode, metric, karakv, baseline, unit, ratio, op, target):
    ok = None if ratio is None else (ratio >= target if op == ">=" else ratio <= target)
    rows.append([mode, metric, "" if karakv is None else f"{karakv:.4g}", "" if baseline is None else f"{baseline:.4g}",
                 unit, "" if ratio is None else f"{ratio:.3f}", f"{op} {target}",
                 "n/a" if ok is None else "PASS" if ok else "FAIL"])
for model in ("llama8b", "smollm2"):
    get = lambda k: values.get(f"{model}.{k}")
    for route, prefix in (("own", ""), ("flashinfer", "fi_")):
        bw, copy, us, sdpa = get(prefix + "decode_bandwidth"), get("copy_bandwidth"), get(prefix + "decode_layer_us"), get("sdpa_layer_us")
        row(f"gpu_decode_{model}", f"fp16 decode ({route}) bandwidth / device copy", bw, copy, "GB/s",
            bw / copy if bw and copy else None, ">=", 0.80)
        row(f"gpu_decode_{model}", f"fp16 decode ({route}) time / SDPA time", us, sdpa, "us",
            us / sdpa if us and sdpa else None, "<=", 1.00)
    for route, prefix in (("staged", ""), ("fused", "fq_")):
        us = get(prefix + "decode_layer_us")
        for fmt, target in (("kivi4", 0.6), ("kivi2", 0.45), ("tq4", 0.7)):
            ratio = get(f"{prefix}quant_{fmt}_vs_fp16")
            row(f"gpu_quant_{model}", f"{fmt} decode ({route}) time / fp16 decode time",
                ratio * us if ratio and us else None, us, "us", ratio, "<=", target)
with open(sys.argv[2], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["mode", "metric", "karakv", "baseline", "unit", "ratio", "target", "result"])
    w.writerows(rows)
print(f"targets: {sum(r[-1] == 'PASS' for r in rows)} PASS, {sum(r[-1] == 'FAIL' for r in rows)} FAIL, "
      f"{sum(r[-1] == 'n/a' for r in rows)} n/a ({sys.argv[2]})")
PY
if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
[ "$tests_ok" -eq 1 ] || exit 1
[ "$sanitizer_rc" -eq 0 ] || exit 1
[ "$ipc_rc" -eq 0 ] || exit 1
[ "$serve_rc" -eq 0 ] || exit 1
[ -z "${p3_failed:-}" ] || exit 1
[ "$serve_device_rc" -eq 0 ] || exit 1
exit 0

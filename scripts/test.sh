#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, and runs every test with ctest
# (unit tests, kernels against float64 references, integration tests with real daemons, and the
# installed SDK consumed by a separate CMake project). The Python-based tests (Python SDK, Helm
# chart, Dockerfile) get their pinned PyPI tools from ctest's pyvenv fixture (tests/tools/).
#
# With no arguments it runs every stage, in order: ctest, asan, tsan, tsan-omp, fuzz (what CI runs).
# Options, for proving a stage on its own (README, "Testing"):
#   --stage NAME[,NAME...]  run only these stages (the main build/ is made only for ctest)
#   --repeat N              run each chosen stage's tests N times (the build is made once); the
#                           first run with a finding stops it, and its reports are printed
#   --busy                  keep every CPU busy with a burner process for the whole run, as a
#                           sidecar's node is (the burners end with the script)
# The same as environment variables: KARAKV_TEST_STAGES, KARAKV_TEST_REPEAT, KARAKV_TEST_BUSY=1.
set -euo pipefail
cd "$(dirname "$0")/.."

stages="${KARAKV_TEST_STAGES:-ctest,asan,tsan,tsan-omp,fuzz}"
repeat="${KARAKV_TEST_REPEAT:-1}"
busy="${KARAKV_TEST_BUSY:-0}"
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) stages="${2:?--stage needs a name: ctest, asan, tsan, tsan-omp or fuzz}"; shift 2 ;;
    --stage=*) stages="${1#--stage=}"; shift ;;
    --repeat) repeat="${2:?--repeat needs a count}"; shift 2 ;;
    --repeat=*) repeat="${1#--repeat=}"; shift ;;
    --busy) busy=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "scripts/test.sh: unknown argument '$1' (expected --stage NAME[,NAME...], --repeat N or --busy)" >&2
       exit 2 ;;
  esac
done
for s in ${stages//,/ }; do
  case "$s" in
    ctest|asan|tsan|tsan-omp|fuzz) ;;
    *) echo "scripts/test.sh: unknown stage '$s' (expected ctest, asan, tsan, tsan-omp or fuzz)" >&2; exit 2 ;;
  esac
done
if ! [[ "$repeat" =~ ^[1-9][0-9]*$ ]]; then
  echo "scripts/test.sh: --repeat must be a whole number >= 1, got '$repeat'" >&2
  exit 2
fi
want() { [[ ",$stages," == *",$1,"* ]]; }

start_seconds=$SECONDS
# The burner: one busy process per CPU, for the whole run (the installs and builds included, as on a
# shared node). They end with the script, however it ends.
burners=()
stop_burners() {
  if [ ${#burners[@]} -gt 0 ]; then kill "${burners[@]}" 2> /dev/null || true; fi
}
trap stop_burners EXIT
if [ "$busy" = 1 ]; then
  for _ in $(seq "$(nproc)"); do
    (exec -a karakv-test-burner bash -c 'while :; do :; done') &
    burners+=($!)
  done
  echo "==> --busy: ${#burners[@]} burner processes keep every CPU busy until the end of the run"
fi

if want ctest; then
  bash scripts/setup.sh
else
  bash scripts/setup.sh --install-only
fi

# Sanitizer findings from every process (test binaries, the karakvd daemons they start, workers,
# the CLI) go to files under $1 as well as failing where they happen; a stage passes only when
# none were written, so a finding in a daemon whose exit status a test ignores still fails CI.
sanitizer_logs() {
  rm -rf "$1" && mkdir -p "$1"
  export ASAN_OPTIONS="log_path=$PWD/$1/asan:detect_leaks=1"
  export UBSAN_OPTIONS="log_path=$PWD/$1/ubsan:print_stacktrace=1:halt_on_error=1"
  export TSAN_OPTIONS="log_path=$PWD/$1/tsan:halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp"
}
check_sanitizer_logs() {
  if compgen -G "$1/*" > /dev/null; then
    echo "sanitizer findings (in $1):" >&2
    cat "$1"/* >&2
    exit 1
  fi
}
integration_tests() {  # $1: build tree
  (cd "$1/tests/integration" && ./integration_test --gtest_brief=1 && ./prefix_integration_test --gtest_brief=1 &&
     ./ring_integration_test --gtest_brief=1)
}
# Runs "$@" (one stage's tests) $repeat times, saying which run this is when there are several.
repeated() {
  local i
  for ((i = 1; i <= repeat; i++)); do
    [ "$repeat" -gt 1 ] && echo "==> run $i of $repeat ($((SECONDS - start_seconds)) s so far)"
    "$@"
  done
}

ctest_stage() {
  # The SmolLM2 tests need the converted model; a failed download must not fail CI, so it only
  # warns and those tests skip.
  bash scripts/fetch_smollm2.sh ||
    echo "WARNING: scripts/fetch_smollm2.sh failed; the SmolLM2 tests will be SKIPPED" >&2
  echo "==> running the test suite"
  repeated bash -c 'cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600'
}

# The unit tests of the kernels and of the daemon's core (pool, sessions, sequence store, compactor, policies, staging, ring,
# prefix cache, limits), the integration tests (real daemons, workers and CLI, all instrumented)
# and the fuzz harnesses' corpora once more, built with AddressSanitizer (leaks included) and
# UndefinedBehaviorSanitizer, any finding fatal. A separate tree, build-asan/; ccache keeps it
# cheap after the first time.
asan_run() {
  sanitizer_logs build-asan/sanitizer-logs
  ./build-asan/tests/kernels/kernels_test --gtest_brief=1
  ./build-asan/tests/server/server_test --gtest_brief=1
  integration_tests build-asan
  ./build-asan/tests/fuzz/service_fuzzer tests/fuzz/corpus/service_fuzzer
  ./build-asan/tests/fuzz/ring_fuzzer tests/fuzz/corpus/ring_fuzzer
  check_sanitizer_logs build-asan/sanitizer-logs
}
asan_stage() {
  echo "==> unit and integration tests under ASan + UBSan (build-asan/)"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKARAKV_SANITIZE=address,undefined \
    -DKARAKV_BUILD_BENCH=OFF > /dev/null
  cmake --build build-asan -j "$(nproc)" --target kernels_test server_test integration_test \
    prefix_integration_test ring_integration_test service_fuzzer ring_fuzzer
  repeated asan_run
  unset ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS
}

# ThreadSanitizer over the daemon's core with its own threads (ring threads, the core under
# concurrent calls, lease expiry): server_test; then the integration tests, whose karakvd daemons,
# workers and CLI are instrumented too, the kernels' pool of threads (kernels/cpu/work_pool.h)
# included. Debian's libabsl and libgrpc are not instrumented, so TSan cannot see absl::Mutex or
# gRPC's handoffs between its threads: tests/tsan_absl_mutex.cc, preloaded, reports each Mutex
# lock/unlock to TSan; and for the integration tests
# ignore_noninstrumented_modules=1 leaves out the memory accesses made inside those libraries
# (gRPC's own call objects), so a race is reported when both accesses are in code built here
# (docs/RELIABILITY.md). Suppressions, each explained: tests/tsan.supp. `--stage tsan --repeat 10
# --busy` is how this stage is proven on a loaded machine (docs/RELIABILITY.md).
tsan_run() {
  sanitizer_logs build-tsan/sanitizer-logs
  LD_PRELOAD="$PWD/build-tsan/tests/libtsan_absl_mutex.so" ./build-tsan/tests/server/server_test --gtest_brief=1
  LD_PRELOAD="$PWD/build-tsan/tests/libtsan_absl_mutex.so" \
    TSAN_OPTIONS="$TSAN_OPTIONS:ignore_noninstrumented_modules=1" integration_tests build-tsan
  check_sanitizer_logs build-tsan/sanitizer-logs
}
tsan_stage() {
  echo "==> server unit tests and integration tests under TSan (build-tsan/)"
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKARAKV_SANITIZE=thread \
    -DKARAKV_BUILD_BENCH=OFF > /dev/null
  cmake --build build-tsan -j "$(nproc)" --target server_test tsan_absl_mutex integration_test \
    prefix_integration_test ring_integration_test
  repeated tsan_run
  unset ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS
}

# The kernels' threads under TSan built by clang (build-tsan-omp/): kernels_test, whose backends run
# their parallel loops on pools of up to 4 threads (kernels/cpu/work_pool.h, instrumented, so a race
# between two chunks of a loop is reported). The tree links LLVM's OpenMP runtime with its Archer
# tool (which needs ignore_noninstrumented_modules=1), for anything that still uses OpenMP.
tsan_omp_run() {
  sanitizer_logs build-tsan-omp/sanitizer-logs
  TSAN_OPTIONS="$TSAN_OPTIONS:ignore_noninstrumented_modules=1" ./build-tsan-omp/tests/kernels/kernels_test --gtest_brief=1
  check_sanitizer_logs build-tsan-omp/sanitizer-logs
}
tsan_omp_stage() {
  echo "==> kernel unit tests under TSan, clang (build-tsan-omp/)"
  CC=clang CXX=clang++ cmake -S . -B build-tsan-omp -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKARAKV_SANITIZE=thread -DKARAKV_BUILD_BENCH=OFF > /dev/null
  cmake --build build-tsan-omp -j "$(nproc)" --target kernels_test
  repeated tsan_omp_run
  unset ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS
}

# libFuzzer (clang, ASan + UBSan) over the request handlers, their protobuf decoding and the fast
# path's ring commands, 30 s a harness from the committed corpora (tests/fuzz/). A crash, a leak,
# a broken pool invariant or a refusal without a message stops the run and fails CI; the input
# is left in build-fuzz/findings/.
fuzz_run() {
  local f
  mkdir -p build-fuzz/findings
  for f in service_fuzzer ring_fuzzer; do
    rm -rf "build-fuzz/corpus/$f" && mkdir -p "build-fuzz/corpus/$f"
    "./build-fuzz/tests/fuzz/$f" -max_total_time=30 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="build-fuzz/findings/$f-" "build-fuzz/corpus/$f" "tests/fuzz/corpus/$f"
  done
}
fuzz_stage() {
  echo "==> fuzzing the handlers and the ring for 30 s each (build-fuzz/)"
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKARAKV_FUZZ=ON \
    -DKARAKV_BUILD_BENCH=OFF > /dev/null
  cmake --build build-fuzz -j "$(nproc)" --target service_fuzzer ring_fuzzer
  repeated fuzz_run
}

want ctest && ctest_stage
want asan && asan_stage
want tsan && tsan_stage
want tsan-omp && tsan_omp_stage
want fuzz && fuzz_stage
busy_note=""
[ "$busy" = 1 ] && busy_note=", every CPU kept busy by burners"
echo "==> all tests passed (stages: $stages; $repeat run(s) each$busy_note) in $((SECONDS - start_seconds)) s"

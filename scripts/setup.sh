#!/usr/bin/env bash
# Installs what karakv needs on Debian 12 (only what is missing) and builds it into build/.
# Used by scripts/demo.sh and scripts/test.sh; safe to run again (ccache makes rebuilds cheap).
# --install-only: the packages, no build (scripts/test.sh --stage for stages with trees of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
install_only=0
case "${1:-}" in
  "") ;;
  --install-only) install_only=1 ;;
  *) echo "scripts/setup.sh: unknown argument '$1' (expected nothing or --install-only)" >&2; exit 2 ;;
esac

# python3-venv: the suite makes <build>/pyvenv for the Python SDK, Helm chart and Dockerfile tests
# (tests/tools/make_venv.sh installs their pinned PyPI packages there).
packages=(cmake ninja-build g++ ccache pkg-config python3-venv
          libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
          libabsl-dev libspdlog-dev prometheus-cpp-dev
          # beyond one node: ZeroMQ and msgpack for KV events, hiredis and xxHash for the prefix tier
          libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libhiredis-dev libxxhash-dev
          libgtest-dev libgmock-dev libbenchmark-dev redis-server
          # the CPU scorers' matrix products: static archives, nothing needed at run time; the
          # build falls back to its own tile code without it, see kernels/CMakeLists.txt
          libxsmm-dev
          # tests/ops: promtool and a real Prometheus server check the metrics, the alert rules and
          # every query of the Grafana dashboard; python3 runs those script tests
          # and parses the karakv-bench serve smoke test's CSVs.
          prometheus python3
          # tests/integration/tls_test.cc makes a throwaway CA and certificates with the openssl CLI.
          openssl
          # scripts/test.sh's fuzzing stage, tests/fuzz: clang with libFuzzer's runtime; its
          # TSan stage for the kernels' OpenMP threads: LLVM's OpenMP runtime with Archer, which
          # tells TSan about OpenMP's barriers.
          clang libclang-rt-14-dev libomp-14-dev
          # scripts/gpu-check.sh --prepare points the carried binaries at their carried loader.
          patchelf)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null
fi

[ "$install_only" = 1 ] && exit 0

jobs=$(nproc)
echo "==> configuring and building (build/, $jobs jobs)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-RelWithDebInfo}" > build.configure.log 2>&1 ||
  { cat build.configure.log; exit 1; }
rm -f build.configure.log
cmake --build build -j "$jobs"

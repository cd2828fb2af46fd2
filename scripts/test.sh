#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, and runs every test with ctest
# (unit tests, kernels against float64 references, integration tests with real daemons, and the
# installed SDK consumed by a separate CMake project).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "==> running the test suite"
cd build
ctest --output-on-failure -j "$(nproc)" --timeout 600

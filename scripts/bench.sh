#!/usr/bin/env bash
# Builds karakv-bench and karakvd, installs redis-server (the P1 baseline) if it is missing, and
# runs every benchmark; results go to build/bench-results/ (CSV, and PNG charts drawn by bench/plot.py;
# matplotlib is installed with pip when it is missing, and the charts are skipped if that fails).
#   scripts/bench.sh [karakv-bench flags...]     e.g. scripts/bench.sh --rounds=3
# Environment: BUILD_DIR (default build), JOBS (default 2), MODE (default all).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
MODE=${MODE:-all}
OUT_DIR="$BUILD_DIR/bench-results"

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DKARAKV_BUILD_BENCH=ON
elif ! grep -q '^KARAKV_BUILD_BENCH:BOOL=ON' "$BUILD_DIR/CMakeCache.txt"; then
  cmake -S . -B "$BUILD_DIR" -DKARAKV_BUILD_BENCH=ON
fi
ninja -C "$BUILD_DIR" -j"$JOBS" karakv-bench karakvd

if ! command -v redis-server >/dev/null; then
  echo "bench.sh: installing redis-server (the P1 baseline)" >&2
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server
  # The Debian package starts a system instance on port 6379; the benchmark runs its own.
fi

mkdir -p "$OUT_DIR"
"$BUILD_DIR/bench/karakv-bench" "$MODE" --karakvd="$BUILD_DIR/server/karakvd" \
  --redis_server="$(command -v redis-server)" --out_dir="$OUT_DIR" "$@" | tee "$OUT_DIR/summary.txt"
if command -v python3 >/dev/null; then
  if ! python3 -c 'import matplotlib' 2>/dev/null; then
    echo "bench.sh: installing matplotlib for the charts (python3 -m pip install matplotlib)" >&2
    python3 -m pip install --quiet matplotlib ||
      echo "bench.sh: could not install matplotlib; no charts (results are in $OUT_DIR)" >&2
  fi
  python3 bench/plot.py "$OUT_DIR" || echo "bench.sh: plot failed (results are in $OUT_DIR)" >&2
fi

#!/usr/bin/env bash
# Runs a command with <build>/pyvenv first on PATH, or exits 77 (ctest: skipped) with the reason
# make_venv.sh recorded when the venv could not be made. Usage: run_in_venv.sh BUILD_DIR CMD...
set -euo pipefail
build=$1
shift
if [ -f "$build/pyvenv.skip" ]; then
  cat "$build/pyvenv.skip"
  exit 77
fi
if [ ! -x "$build/pyvenv/bin/python" ]; then
  echo "SKIP: $build/pyvenv missing (the pyvenv fixture did not run)"
  exit 77
fi
export PATH="$build/pyvenv/bin:$PATH"
exec "$@"

#!/usr/bin/env bash
# Installs the build tree into a temporary prefix and builds and runs a separate project against
# it with find_package(karakv). Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
test -f "$tmp/prefix/include/karakv/client.h"
test -x "$tmp/prefix/bin/karakvd"
test -x "$tmp/prefix/bin/karakv"
gen=()
command -v ninja > /dev/null && gen=(-G Ninja)
cmake -S "$src/tests/client/consumer" -B "$tmp/build" "${gen[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" > "$tmp/configure.log"
cmake --build "$tmp/build" > "$tmp/build.log"
LD_LIBRARY_PATH="$tmp/prefix/lib:${LD_LIBRARY_PATH:-}" "$tmp/build/consumer"

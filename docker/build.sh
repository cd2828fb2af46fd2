#!/bin/sh
# Builds karakv in the image's builder stage and lays out what the runtime image needs under
# DEST (bin/: karakvd, karakv, synthetic_worker; lib/: the C++ SDK library). Usage: build.sh DEST
set -eu
dest=$1
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKARAKV_BUILD_TESTS=OFF -DKARAKV_BUILD_BENCH=OFF -DCMAKE_INSTALL_PREFIX=/usr/local \
  -DKARAKV_GIT_REVISION="${KARAKV_GIT_REVISION:-}"
cmake --build build
DESTDIR=/tmp/install cmake --install build
mkdir -p "$dest/bin" "$dest/lib"
cp /tmp/install/usr/local/bin/karakvd /tmp/install/usr/local/bin/karakv build/examples/synthetic_worker "$dest/bin/"
cp -P /tmp/install/usr/local/lib/libkarakv_client.so* "$dest/lib/"
strip "$dest/bin/"* "$dest/lib/"libkarakv_client.so.*.*.*

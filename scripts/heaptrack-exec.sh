#!/usr/bin/env bash
# Runs a command under heaptrack with the command's own pid (exec), so signals reach it directly:
# `heaptrack CMD` keeps a shell in between that takes SIGTERM itself and leaves CMD running.
#   HEAPTRACK_OUT=FILE.zst scripts/heaptrack-exec.sh CMD ARGS...
# With HEAPTRACK_TARGET set, the command is $HEAPTRACK_TARGET followed by this script's arguments,
# so the script can stand in for a binary that another program starts with its own flags:
#   HEAPTRACK_OUT=/tmp/karakvd.zst HEAPTRACK_TARGET=build/server/karakvd \
#     build/bench/karakv-bench soak --karakvd=scripts/heaptrack-exec.sh ...
# Then scripts/heap_growth.py /tmp/karakvd.zst 90 570 shows what the live heap gained between
# 90 s and 570 s, by allocation stack. Needs Debian's heaptrack and zstd.
set -euo pipefail
out="${HEAPTRACK_OUT:?set HEAPTRACK_OUT to the .zst file to write}"
lib=/usr/lib/heaptrack
[ -x "$lib/libexec/heaptrack_interpret" ] || { echo "heaptrack-exec: $lib/libexec/heaptrack_interpret not found (apt-get install heaptrack)" >&2; exit 2; }
dir=$(mktemp -d)
mkfifo "$dir/pipe"
# The interpreter ends when the traced process closes the pipe (at exit).
( "$lib/libexec/heaptrack_interpret" < "$dir/pipe" | zstd -q -c > "$out"; rm -rf "$dir" ) &
LD_PRELOAD="$lib/libheaptrack_preload.so${LD_PRELOAD:+:$LD_PRELOAD}" DUMP_HEAPTRACK_OUTPUT="$dir/pipe" exec ${HEAPTRACK_TARGET:+"$HEAPTRACK_TARGET"} "$@"

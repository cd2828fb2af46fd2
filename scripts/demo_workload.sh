#!/usr/bin/env bash
# The demo's synthetic workload (scripts/demo.sh), against a running karakvd: the same sequences
# decoded once without compression and once with Kara, each run ending with what it kept in KV
# memory, then one line comparing the two. tests/examples/demo_workload_test.sh runs this file as
# it is, so the demo is known to show Kara saving memory.
#   $1: build tree (build/), $2: the daemon's target (unix:/path or host:port)
#   SEQUENCES, PROMPT, GENERATE: the workload (16, 512, 256)
set -euo pipefail
build="${1:?usage: demo_workload.sh BUILD_DIR TARGET}"
target="${2:?usage: demo_workload.sh BUILD_DIR TARGET}"
generate="${GENERATE:-256}"
workload=(--target="$target" --sequences="${SEQUENCES:-16}" --prompt="${PROMPT:-512}"
          --generate="$generate" --check_every=16)
# Kara compresses a window of W generated tokens once R newer ones follow it; its defaults (W 128,
# R 256) are tuned for long generations, and the demo's 256 tokens would close no window at all.
# A window and a recent region of 64 close a window every 64 tokens from the 128th on.
kara=(--param=window=64,recent=64)
if [ "$generate" -lt 128 ]; then
  echo "demo_workload.sh: GENERATE=$generate is under 128 tokens, so Kara (window 64, recent 64) closes no window" >&2
fi

# The "compress:" line's KV MiB, from a run's output.
kv_mib() { sed -n 's/^compress: .*, \([0-9.]*\) MiB of KV$/\1/p' <<< "$1" | tail -n 1; }

echo "==> driving the workload without compression"
none_out=$("$build/examples/synthetic_worker" "${workload[@]}" --policy=none)
echo "$none_out"
echo
echo "==> the same workload with Kara: periodic sliding-window compression of the generated tokens"
echo "    (window 64, recent 64 for this short run, so it closes a window every 64 tokens from the 128th)"
kara_out=$("$build/examples/synthetic_worker" "${workload[@]}" --policy=kara "${kara[@]}")
echo "$kara_out"
none_kv=$(kv_mib "$none_out")
kara_kv=$(kv_mib "$kara_out")
echo
if [ -n "$none_kv" ] && [ -n "$kara_kv" ]; then
  awk -v n="$none_kv" -v k="$kara_kv" 'BEGIN {
    printf "==> KV memory kept: none %.1f MiB, kara %.1f MiB (%.0f%% less)\n", n, k, (n > 0 ? 100 * (1 - k / n) : 0) }'
else
  echo "==> KV memory kept: not found in the workers' output" >&2
  exit 1
fi

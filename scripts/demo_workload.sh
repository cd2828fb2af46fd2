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
# Kara holds each sequence at a memory budget: once it holds more, every 16th step re-ranks what is
# older than its newest R tokens (the prompt included, unless shared) by the attention decode steps
# gave it, down to the budget. Its defaults (768 tokens, R 256) suit long generations; the demo's
# sequences (a 512-token prompt and 256 generated tokens) would never reach them, so this run sets
# a budget of 256 and R 64.
kara=(--param=budget=256,recent=64)
if [ $(( ${PROMPT:-512} + generate )) -le 256 ]; then
  echo "demo_workload.sh: PROMPT + GENERATE is at most 256 tokens, Kara's budget here, so it compresses nothing" >&2
fi

# The "compress:" line's KV MiB, from a run's output.
kv_mib() { sed -n 's/^compress: .*, \([0-9.]*\) MiB of KV$/\1/p' <<< "$1" | tail -n 1; }

echo "==> driving the workload without compression"
none_out=$("$build/examples/synthetic_worker" "${workload[@]}" --policy=none)
echo "$none_out"
echo
echo "==> the same workload with Kara: each sequence held at a budget of 256 tokens for this short run"
echo "    (the default is 768), its newest 64 kept whole, the rest re-ranked by decode attention every 16 steps"
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

#!/usr/bin/env bash
# scripts/demo_workload.sh, as the demo runs it (its default 256 generated tokens), against a real
# karakvd: Kara must compact, and keep less KV memory than `none` on the same workload.
#   $1: source tree, $2: build tree
set -euo pipefail
src="$1" build="$2"
dir=$(mktemp -d)
sock="$dir/karakvd.sock"
"$build/server/karakvd" --socket="$sock" --pool_bytes=256MiB > "$dir/karakvd.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2> /dev/null || true; wait $daemon 2> /dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 200); do
  "$build/client/karakv" --target="unix:$sock" --timeout=0.2 health > /dev/null 2>&1 && break
  sleep 0.1
done
out=$(SEQUENCES=2 PROMPT=64 bash "$src/scripts/demo_workload.sh" "$build" "unix:$sock" 2> /dev/null)
echo "$out"
fail() { echo "FAIL: $*" >&2; exit 1; }
kara=$(grep '^compress: kara:' <<< "$out") || fail "no compress line for kara"
none=$(grep '^compress: none:' <<< "$out") || fail "no compress line for none"
compactions=$(sed -n 's/.* \([0-9]*\) compactions.*/\1/p' <<< "$kara")
[ "${compactions:-0}" -gt 0 ] || fail "Kara made no compaction in the demo's workload: $kara"
resident=$(sed -n 's/^compress: kara: \([0-9]*\) resident of \([0-9]*\) logical.*/\1 \2/p' <<< "$kara")
read -r res logical <<< "$resident"
[ "$res" -lt "$logical" ] || fail "Kara kept every token ($res of $logical): $kara"
summary=$(grep '^==> KV memory kept: ' <<< "$out") || fail "no KV memory summary line"
read -r none_kv kara_kv <<< "$(sed -n 's/.*none \([0-9.]*\) MiB, kara \([0-9.]*\) MiB.*/\1 \2/p' <<< "$summary")"
awk -v n="${none_kv:-0}" -v k="${kara_kv:-0}" 'BEGIN { exit !(k > 0 && k < n) }' ||
  fail "Kara kept no less KV memory than none: $summary"
grep -q '^check   : .*ALL MATCHED' <<< "$out" || fail "attention checks did not all match"
echo "demo workload: $compactions Kara compactions; $summary"

#!/usr/bin/env bash
# scripts/gpu-check.sh where CI runs: its usage, its refusal of an unknown argument, and its no-device
# path (a machine without a GPU prints "no device" and exits 0). On a machine with a GPU the
# no-device path cannot be reached: exit 77 (ctest: skipped).
set -uo pipefail
root=$1
script="$root/scripts/gpu-check.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }

help=$(bash "$script" --help) || fail "--help exited $?"
grep -q -- "--prepare" <<< "$help" || fail "--help does not describe --prepare"
grep -q -- "--results DIR" <<< "$help" || fail "--help does not describe --results"
bash "$script" --bogus > /dev/null 2>&1
rc=$?
[ "$rc" -eq 2 ] || fail "an unknown argument exited $rc, expected 2"

if nvidia-smi -L > /dev/null 2>&1; then
  echo "a GPU is here: the no-device path cannot be checked"
  exit 77
fi
out=$(cd "$root" && bash "$script" --results "$(mktemp -d)" 2>&1)
rc=$?
[ "$rc" -eq 0 ] || fail "the no-device path exited $rc: $out"
grep -q '^no device' <<< "$out" || fail "the no-device path did not say 'no device': $out"
echo "ok: $out"

#!/usr/bin/env bash
# scripts/test.sh's options (--stage, --repeat, --busy): what it refuses, before it installs or
# builds anything, and that each refusal says what was expected.
#   $1: source tree
set -uo pipefail
script="$1/scripts/test.sh"
failed=0
expect_refused() {  # $1: what the message must contain; the rest: the arguments
  local want="$1" out code
  shift
  out=$(bash "$script" "$@" 2>&1 < /dev/null)
  code=$?
  if [ "$code" -ne 2 ] || [[ "$out" != *"$want"* ]]; then
    echo "FAIL: scripts/test.sh $* exited $code, printed: $out (wanted exit 2 and '$want')"
    failed=1
  else
    echo "ok: scripts/test.sh $* refused: $out"
  fi
}
expect_refused "unknown stage 'bogus' (expected ctest, asan, tsan, tsan-omp or fuzz)" --stage bogus
expect_refused "unknown stage 'tsa' (expected" --stage=tsan,tsa
expect_refused "--repeat must be a whole number >= 1, got '0'" --stage tsan --repeat 0
expect_refused "--repeat must be a whole number >= 1, got 'x'" --repeat=x
expect_refused "unknown argument '--fast'" --fast
out=$(KARAKV_TEST_STAGES=nope bash "$script" 2>&1 < /dev/null); code=$?
if [ "$code" -ne 2 ] || [[ "$out" != *"unknown stage 'nope'"* ]]; then
  echo "FAIL: KARAKV_TEST_STAGES=nope exited $code: $out"; failed=1
fi
help=$(bash "$script" --help)
for opt in --stage --repeat --busy; do
  [[ "$help" == *"$opt"* ]] || { echo "FAIL: --help does not describe $opt"; failed=1; }
done
[ "$failed" -eq 0 ] && echo "1 passed, 0 failed" || echo "0 passed, 1 failed"
exit "$failed"

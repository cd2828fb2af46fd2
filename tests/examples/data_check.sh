#!/usr/bin/env bash
# The repository is self-contained: every file data/README.md lists is in data/ with the sha256 the
# table gives, and no tracked file points outside the checkout for its data (a path into the
# development machines' shared data folder, next to the checkout).
set -euo pipefail
root=$1
cd "$root"
rows=$(grep -E '^\| `[^`]+` \|' data/README.md)
[ -n "$rows" ] || { echo "FAIL: no file rows in data/README.md's table"; exit 1; }
status=0
while IFS= read -r row; do
  file=$(sed -E 's/^\| `([^`]+)` \|.*/\1/' <<< "$row")
  sum=$(grep -oE '`[0-9a-f]{64}`' <<< "$row" | tr -d '`')
  if [ -z "$sum" ]; then
    echo "FAIL: data/README.md lists $file without a sha256"; status=1; continue
  fi
  if [ ! -f "data/$file" ]; then
    echo "FAIL: data/$file is listed in data/README.md but missing"; status=1; continue
  fi
  actual=$(sha256sum "data/$file" | cut -d' ' -f1)
  if [ "$actual" != "$sum" ]; then
    echo "FAIL: data/$file has sha256 $actual, expected $sum (data/README.md)"; status=1
  else
    echo "ok: data/$file"
  fi
done <<< "$rows"
# Tracked files only when this is a git checkout; otherwise every file outside build trees.
outside='\.\./'"shared"  # spelled in two pieces so that this file does not match itself
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  hits=$(git grep -nI -e "$outside" -- . || true)
else
  hits=$(grep -rnI --exclude-dir='build*' --exclude-dir=.git -e "$outside" . || true)
fi
if [ -n "$hits" ]; then
  echo "FAIL: files read data from outside the checkout (the shared data folder):"; echo "$hits"; status=1
fi
exit $status

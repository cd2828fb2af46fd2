#!/usr/bin/env bash
# llama_quality --quick on stories260K through real daemons: it runs to the end, its CSV has a row
# per (task, policy) it ran, the `none` run equals the in-process dense reference, and a compressing
# policy really holds fewer tokens than it was given. Numbers beyond that are the harness's to
# report, not this test's to pin.
set -euo pipefail
quality=$1 model=$2
[ -f "$model" ] || { echo "FAIL: model file not found: $model (the repository keeps it in data/)"; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$quality" --quick --model="$model" --csv="$dir/q.csv" > "$dir/out.txt"
cat "$dir/out.txt"
python3 - "$dir/q.csv" <<'PY'
import csv, math, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {(r["task"], r["policy"]): r for r in rows}
expect = {("stories", p) for p in ("none", "kara-0.50", "kara-0.25", "snapkv")}
expect |= {("stories-greedy", p) for p in ("none", "kara-0.50", "kara-0.25", "snapkv")}
missing = expect - by.keys()
assert not missing, f"rows missing: {sorted(missing)}"
none = by[("stories", "none")]
assert float(none["max_abs_dlogp_vs_dense"]) < 1e-2, none
assert float(none["ppl_vs_none_pct"]) == 0.0
assert float(by[("stories-greedy", "none")]["greedy_agreement"]) == 1.0
for p in ("kara-0.50", "kara-0.25", "snapkv"):
    r = by[("stories", p)]
    assert float(r["resident_final"]) < float(r["logical_final"]), r
    assert math.isfinite(float(r["perplexity"])) and float(r["perplexity"]) > 1, r
    assert 0 <= float(by[("stories-greedy", p)]["greedy_agreement"]) <= 1
# Kara at rho 0.25 keeps less than at 0.5.
assert float(by[("stories", "kara-0.25")]["resident_final"]) < float(by[("stories", "kara-0.50")]["resident_final"])
print("quality smoke: ok,", len(rows), "rows")
PY

#!/usr/bin/env python3
"""Short run of `karakv-bench soak`: 3 worker processes do random operations and crash on purpose
against a real karakvd for 24 seconds. It must exit 0 (no unexpected error, no invariant failure, no
output differing from the reference, every crashed worker's session and blocks back), and soak.csv
must show that each kind of operation, crash and check actually happened.

The RSS limit is loose here (a 24-second run is mostly allocator warm-up); the 1% goal is judged
by the 10-minute figure in docs/RELIABILITY.md. The growth the soak judges, the Theil-Sen trend of
the daemon's RSS after the warm-up, is refitted here from soak_rss.csv with a plain float64 loop
and must agree.

Usage: soak_quick_test.py KARAKV_BENCH KARAKVD
"""
import csv
import os
import subprocess
import sys
import tempfile

OPS = ["attach", "create", "append", "step", "compact", "fork", "release", "detach", "crash", "probe"]


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def median(v):
    v = sorted(v)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def theil_sen(points):
    """The median slope over all pairs of points with different t, and the median intercept."""
    slopes = [(yj - yi) / (tj - ti) for i, (ti, yi) in enumerate(points) for tj, yj in points[i + 1:] if tj != ti]
    slope = median(slopes) if slopes else 0.0
    return slope, median([y - slope * t for t, y in points])


def check_trend(out, get):
    """The soak's RSS trend against an independent refit of the samples it wrote."""
    with open(os.path.join(out, "soak_rss.csv"), newline="") as f:
        samples = [(float(r["t_s"]), int(r["rss_kib"]), int(r["anon_kib"])) for r in csv.DictReader(f)]
    warmup, end = get("run", "warmup_s"), get("run", "end_s")
    after = [s for s in samples if s[0] >= warmup]
    stride = int(get("rss", "trend_stride"))
    if stride != max(1, -(-len(after) // 3000)):
        fail(f"trend stride {stride} for {len(after)} samples, expected one that keeps at most 3000")
    after = after[::stride]
    if len(after) < 10 or get("rss", "trend_points") != len(after):
        fail(f"{len(after)} RSS samples after the {warmup} s warm-up, soak.csv says {get('rss', 'trend_points')}")
    for column, key in ((1, "growth_pct"), (2, "anon_growth_pct")):
        slope, intercept = theil_sen([(s[0], s[column]) for s in after])
        start, stop = intercept + slope * warmup, intercept + slope * end
        want = 100 * (stop - start) / start
        if abs(get("rss", key) - want) > 1e-3:
            fail(f"soak.csv rss,{key} {get('rss', key)}, a float64 Theil-Sen refit says {want:.4f}")
        if key == "growth_pct" and (abs(get("rss", "trend_start_kib") - start) > 1e-2 or
                                    abs(get("rss", "trend_end_kib") - stop) > 1e-2):
            fail(f"trend {get('rss', 'trend_start_kib')} -> {get('rss', 'trend_end_kib')} KiB, "
                 f"the refit says {start:.3f} -> {stop:.3f}")


def main():
    bench, karakvd = sys.argv[1:3]
    with tempfile.TemporaryDirectory(prefix="karakv-soak-quick.") as out:
        cmd = [bench, "soak", "--workers=3", "--minutes=0.4", "--seed=7", "--soak_crash_mean_s=6",
               "--soak_max_rss_growth_pct=25", f"--karakvd={karakvd}", f"--out_dir={out}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if proc.returncode != 0:
            fail(f"{' '.join(cmd[1:])} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                 f"stderr tail:\n{proc.stderr[-2000:]}")
        path = os.path.join(out, "soak.csv")
        if not os.path.exists(path):
            fail("soak.csv was not written")
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != ["section", "key", "value"]:
                fail(f"soak.csv columns are {reader.fieldnames}, expected section,key,value")
            rows = {(r["section"], r["key"]): r["value"] for r in reader}

        def get(section, key):
            if (section, key) not in rows:
                fail(f"soak.csv has no {section},{key} row")
            return float(rows[(section, key)])

        if rows.get(("result", "verdict")) != "PASS":
            fail(f"verdict {rows.get(('result', 'verdict'))!r}, expected PASS")
        for op in OPS:
            if get("ops", op) < 1:
                fail(f"no {op} operation in 24 s with 3 workers: {rows}")
        if get("errors", "unexpected") != 0 or any(s == "errors_unexpected" for s, _ in rows):
            fail(f"unexpected errors in soak.csv: {rows}")
        # Probes of crashed or detached sessions' sequences must all have said NOT_FOUND.
        if get("errors_expected", "NOT_FOUND") != get("ops", "probe"):
            fail(f"{get('ops', 'probe')} probes but {rows.get(('errors_expected', 'NOT_FOUND'))} NOT_FOUND")
        if get("checks", "invariant_checks") < 10 or get("checks", "invariant_failures") != 0:
            fail(f"invariant checks {get('checks', 'invariant_checks')}, failures {get('checks', 'invariant_failures')}")
        if get("checks", "step_outputs_checked") < 1 or get("checks", "step_mismatches") != 0:
            fail(f"Step outputs checked {get('checks', 'step_outputs_checked')}, "
                 f"mismatches {get('checks', 'step_mismatches')}")
        if get("checks", "readkv_checked") < 1 or get("checks", "readkv_mismatches") != 0:
            fail(f"ReadKV checked {get('checks', 'readkv_checked')}, mismatches {get('checks', 'readkv_mismatches')}")
        if get("checks", "max_abs_err") > 1e-4:
            fail(f"max |err| {get('checks', 'max_abs_err')} above 1e-4")
        crashes = get("workers", "crashes")
        # A worker that crashes while the run stops is not replaced: up to one per worker.
        if crashes < 1 or get("workers", "restarts") < crashes - 3 or get("workers", "unexpected_exits") != 0:
            fail(f"crashes {crashes}, restarts {get('workers', 'restarts')}, "
                 f"unexpected exits {get('workers', 'unexpected_exits')}")
        if get("daemon", "lease_expiries") != crashes:
            fail(f"{get('daemon', 'lease_expiries')} lease expiries for {crashes} crashes")
        if not 0 <= get("daemon", "drain_s") <= 2 * get("run", "lease_seconds") + 5:
            fail(f"sessions and blocks not returned after the run (drain_s {get('daemon', 'drain_s')})")
        if get("rss", "start_kib") <= 0 or get("rss", "end_kib") <= 0:
            fail("the daemon's RSS was not read")
        check_trend(out, get)
        # karakvd starts its 16 ring threads with it; 3 workers never hold more fast-path sessions.
        if get("rss", "start_threads") < 17 or get("rss", "max_threads") < get("rss", "start_threads"):
            fail(f"the daemon's threads: start {get('rss', 'start_threads')}, max {get('rss', 'max_threads')} "
                 "(expected at least its 16 ring threads and the main thread)")
        for needle in ("operation", "error code", "invariant checks", "daemon RSS", "result: PASS"):
            if needle not in proc.stdout:
                fail(f"stdout lacks {needle!r}:\n{proc.stdout[-3000:]}")
    print(f"OK: {int(get('ops', 'total'))} operations ({get('ops', 'per_s')}/s), {int(crashes)} crashes, "
          f"{int(get('checks', 'step_outputs_checked'))} Step outputs and "
          f"{int(get('checks', 'readkv_checked'))} caches checked, RSS growth {get('rss', 'growth_pct')}%, "
          f"threads {int(get('rss', 'start_threads'))} -> {int(get('rss', 'end_threads'))}")


if __name__ == "__main__":
    main()

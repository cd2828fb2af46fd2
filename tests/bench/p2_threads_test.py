#!/usr/bin/env python3
"""P2's streaming-read baseline runs on every CPU this process may use, whatever OpenMP's defaults
have become: `karakv-bench p1 p2` (P1 first, which once left OpenMP at one thread so that P2 compared
its decode with a one-thread read), small, once as it is and once pinned to one CPU with taskset.
Every P2 row must name the same thread count, and that count must be the CPUs available: the
affinity mask, capped by the cgroup's CPU quota (rounded up), as karakvd's own thread count is.
Times are not judged. A block size out of range (--p2_block_size, --p5_block_size) is refused with
its range.

Usage: p2_threads_test.py KARAKV_BENCH
"""
import csv
import io
import math
import os
import re
import shutil
import subprocess
import sys


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def cgroup_quota_cpus():
    """The CPU quota of this process's cgroup v2 (cpu.max), or None. The bench reads v1 too and walks
    the parents; this test's machines use v2 at the root of their cgroup namespace."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
    except OSError:
        return None
    if path is None:
        return None
    best = None
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts), -1, -1):
        try:
            with open(os.path.join("/sys/fs/cgroup", *parts[:i], "cpu.max")) as f:
                quota, period = f.read().split()
        except (OSError, ValueError):
            continue
        if quota != "max":
            cpus = int(quota) / int(period)
            best = cpus if best is None else min(best, cpus)
    return best


def expected_threads(affinity):
    quota = cgroup_quota_cpus()
    return max(1, min(affinity, math.ceil(quota))) if quota else max(1, affinity)


def p2_threads(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        fail(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    text = p.stdout[p.stdout.index("mode,metric,"):] if "mode,metric," in p.stdout else ""
    rows = [r for r in csv.DictReader(io.StringIO(text)) if r.get("mode") == "P2"]
    if len(rows) < 3:
        fail(f"fewer than 3 P2 rows in the CSV:\n{p.stdout}")
    counts = set()
    for r in rows:
        m = re.fullmatch(r"streaming read, (\d+) threads", r["baseline_name"])
        if not m:
            fail(f"P2 row '{r['metric']}' has baseline '{r['baseline_name']}', not 'streaming read, N threads'")
        counts.add(int(m.group(1)))
        if not r["metric"].startswith("streaming read, 1 thread") and not r["metric"].endswith(f" {m.group(1)} threads"):
            fail(f"P2 row '{r['metric']}' does not say how many threads it used ({m.group(1)})")
    if len(counts) != 1:
        fail(f"P2 rows name different baseline thread counts: {sorted(counts)}")
    return counts.pop()


def main():
    bench = sys.argv[1]
    cmd = [bench, "p1", "p2", "--csv", "--seconds=0.05", "--rounds=1", "--p2_sequences=2", "--p2_tokens=256",
           "--p2_reps=1", "--p2_daemon=false"]
    affinity = len(os.sched_getaffinity(0))
    got, want = p2_threads(cmd), expected_threads(affinity)
    print(f"as it is: baseline on {got} threads; CPUs available {want} (affinity {affinity})")
    if got != want:
        fail(f"the baseline ran on {got} threads, but this process may use {want} CPUs")
    taskset = shutil.which("taskset")
    if taskset and affinity > 1:
        first = sorted(os.sched_getaffinity(0))[0]
        got = p2_threads([taskset, "-c", str(first)] + cmd)
        print(f"pinned to CPU {first}: baseline on {got} threads")
        if got != 1:
            fail(f"pinned to one CPU, the baseline ran on {got} threads")
    else:
        print("pinned run skipped: taskset missing or only one CPU")
    # A block size out of range is refused before anything runs, naming the flag and the range
    # (P2's and P5's, the two modes that take one).
    for mode in ("p2", "p5"):
        for bad in ("0", "1025"):
            flag = f"--{mode}_block_size={bad}"
            p = subprocess.run([bench, mode, flag], capture_output=True, text=True, timeout=120)
            out = p.stdout + p.stderr
            if p.returncode == 0 or flag not in out or "expected 1 to 1024" not in out:
                fail(f"{mode} {flag} exited {p.returncode} without naming the flag and its range:\n{out}")
    print("block sizes 0 and 1025 refused by p2 and p5")
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Smoke test of `karakv-bench serve --quick`: it runs to the end against a real karakvd, and what it
writes parses: serve_runs.csv has one well-formed row per (policy, max batch), serve_series.csv a
series for each run, serve.csv the P4 rows, and stdout the per-run table. The numbers themselves
are not judged (a benchmark shows speed; a test on a shared 2-core machine must not). The open
loop (--serve_rates) is run too: arrivals as many as the rate and the run's length make likely,
TTFT from arrival recorded, every arrival either served or counted unserved, and a bad rate
refused naming the flag; a request that cannot fit an empty pool is an error naming the sizes.

Usage: serve_quick_test.py KARAKV_BENCH KARAKVD PLOT_PY
"""
import csv
import math
import os
import subprocess
import sys
import tempfile

POLICIES = ["none", "snapkv", "kara", "streaming", "kara+kivi4"]
BATCHES = [8, 32]
RUN_COLUMNS = [
    "policy", "max_batch", "seconds", "steps", "output_tokens", "throughput_tok_s", "tpot_mean_ms", "tpot_p99_ms",
    "ttft_mean_ms", "mean_decoding", "preemptions", "prefill_refusals", "admitted", "finished", "mean_kv_mib",
    "peak_kv_mib", "compactions", "compaction_s", "compaction_share", "ratio_lt1k", "ratio_1_4k", "ratio_4_16k",
    "ratio_ge16k", "rate_req_s", "arrived", "unserved", "ttft_p50_ms", "ttft_p99_ms", "mean_waiting", "mean_queue"]
SERIES_COLUMNS = ["policy", "max_batch", "step", "t_s", "decoding", "waiting", "blocks_used", "kv_mib", "rate_req_s"]


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def read(path, columns):
    if not os.path.exists(path):
        fail(f"{os.path.basename(path)} was not written")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != columns:
            fail(f"{os.path.basename(path)} columns are {reader.fieldnames}, expected {columns}")
        return list(reader)


def number(row, column, what):
    try:
        v = float(row[column])
    except ValueError:
        fail(f"{what}: {column} = {row[column]!r} is not a number")
    if not math.isfinite(v) or v < 0:
        fail(f"{what}: {column} = {v} is not a finite non-negative number")
    return v


def main():
    bench, karakvd, plot = sys.argv[1:4]
    with tempfile.TemporaryDirectory(prefix="karakv-serve-quick.") as out:
        proc = subprocess.run([bench, "serve", "--quick", f"--karakvd={karakvd}", f"--out_dir={out}"],
                              capture_output=True, text=True, timeout=280)
        if proc.returncode != 0:
            fail(f"karakv-bench serve --quick exited {proc.returncode}\nstderr tail:\n{proc.stderr[-3000:]}")

        runs = read(os.path.join(out, "serve_runs.csv"), RUN_COLUMNS)
        seen = sorted((r["policy"], int(r["max_batch"])) for r in runs)
        expected = sorted((p, b) for p in POLICIES for b in BATCHES)
        if seen != expected:
            fail(f"serve_runs.csv has runs {seen}, expected {expected}")
        for r in runs:
            what = f"run {r['policy']} max batch {r['max_batch']}"
            for c in RUN_COLUMNS[2:]:
                number(r, c, what)
            # A run that decoded nothing did not run at all.
            if int(r["steps"]) < 1 or int(r["output_tokens"]) < 1 or int(r["admitted"]) < 1:
                fail(f"{what}: no steps, output tokens or admitted requests: {r}")
            if float(r["mean_decoding"]) > int(r["max_batch"]):
                fail(f"{what}: {r['mean_decoding']} sequences decoding on average, above the max batch")
            if float(r["rate_req_s"]) != 0 or int(r["arrived"]) != 0 or int(r["unserved"]) != 0:
                fail(f"{what}: a closed-loop run reports an arrival rate, arrivals or unserved requests: {r}")

        series = read(os.path.join(out, "serve_series.csv"), SERIES_COLUMNS)
        for p, b in expected:
            mine = [s for s in series if s["policy"] == p and int(s["max_batch"]) == b]
            if not mine:
                fail(f"serve_series.csv has no series for {p} max batch {b}")
            steps = [int(s["step"]) for s in mine]
            if steps != sorted(steps):
                fail(f"serve_series.csv steps of {p} max batch {b} are not increasing")
            for s in mine:
                number(s, "kv_mib", f"series {p} {b}")
                if int(s["decoding"]) > b:
                    fail(f"series {p} max batch {b}: {s['decoding']} sequences decoding at step {s['step']}")

        with open(os.path.join(out, "serve.csv"), newline="") as f:
            summary = list(csv.DictReader(f))
        if not summary or any(r["mode"] != "P4" or r["result"] not in ("PASS", "MISS", "info") for r in summary):
            fail(f"serve.csv should hold the P4 rows, got {summary}")
        for needle in ("P4", "output tok/s at max batch 32, kara", "policy", "kara+kivi4"):
            if needle not in proc.stdout:
                fail(f"stdout lacks {needle!r}:\n{proc.stdout[-3000:]}")

        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("note: matplotlib is not installed; the chart was not drawn (the CSV checks ran)")
        else:
            drawn = subprocess.run([sys.executable, plot, out], capture_output=True, text=True, timeout=120)
            png = os.path.join(out, "serve.png")
            if drawn.returncode != 0 or not os.path.exists(png):
                fail(f"plot.py did not draw serve.png: {drawn.stderr[-2000:]}")
            with open(png, "rb") as f:
                if f.read(8) != b"\x89PNG\r\n\x1a\n":
                    fail("serve.png is not a PNG")
    check_staging_flag(bench, karakvd)
    open_runs = check_open_loop(bench, karakvd, plot)
    print(f"OK: {len(runs)} serve runs parsed, {len(series)} series points, {len(summary)} P4 rows; "
          f"{open_runs} open-loop runs; --serve_staging, --serve_rates and --serve_kara_params refusals named")


def check_open_loop(bench, karakvd, plot):
    """--serve_rates: Poisson arrivals at the rate, TTFT from arrival; a rate that is not > 0 refused."""
    rate = 40.0
    with tempfile.TemporaryDirectory(prefix="karakv-serve-open.") as out:
        proc = subprocess.run([bench, "serve", "--quick", "--serve_policies=none,kara", f"--serve_rates={rate:g}",
                               f"--karakvd={karakvd}", f"--out_dir={out}"], capture_output=True, text=True, timeout=200)
        if proc.returncode != 0:
            fail(f"serve --serve_rates={rate:g} exited {proc.returncode}\nstderr tail:\n{proc.stderr[-3000:]}")
        runs = read(os.path.join(out, "serve_runs.csv"), RUN_COLUMNS)
        if sorted((r["policy"], int(r["max_batch"])) for r in runs) != sorted(
                (p, b) for p in ("none", "kara") for b in BATCHES):
            fail(f"open loop: runs {[(r['policy'], r['max_batch']) for r in runs]}")
        for r in runs:
            what = f"open-loop run {r['policy']} max batch {r['max_batch']}"
            for c in RUN_COLUMNS[2:]:
                number(r, c, what)
            if float(r["rate_req_s"]) != rate:
                fail(f"{what}: rate_req_s {r['rate_req_s']}, expected {rate:g}")
            arrived, unserved, seconds = int(r["arrived"]), int(r["unserved"]), float(r["seconds"])
            # Poisson: within 6 standard deviations of rate x seconds (a false alarm about 1 in 10^9).
            mean = rate * seconds
            if abs(arrived - mean) > 6 * math.sqrt(mean) + 2:
                fail(f"{what}: {arrived} arrivals in {seconds:.2f} s at {rate:g} req/s (expected about {mean:.0f})")
            if unserved > arrived or int(r["admitted"]) < 1:
                fail(f"{what}: {unserved} unserved of {arrived} arrivals, {r['admitted']} admitted")
            if unserved > 0 and float(r["mean_waiting"]) <= 0:
                fail(f"{what}: {unserved} requests never served, yet the queue was empty at every step")
            queue = float(r["mean_queue"])
            if queue < 0 or queue > arrived or (unserved > 0 and queue <= 0):
                fail(f"{what}: mean queue over time {queue} with {unserved} unserved of {arrived} arrivals")
            p50, p99 = float(r["ttft_p50_ms"]), float(r["ttft_p99_ms"])
            if not 0 < p50 <= p99:
                fail(f"{what}: TTFT p50 {p50} and p99 {p99} ms are not 0 < p50 <= p99")
        series = read(os.path.join(out, "serve_series.csv"), SERIES_COLUMNS)
        if not series or any(float(s["rate_req_s"]) != rate for s in series):
            fail("open loop: serve_series.csv rows should all carry the rate")
        with open(os.path.join(out, "serve.csv"), newline="") as f:
            summary = list(csv.DictReader(f))
        if not summary or any(s["mode"] != "serve-open" or s["result"] != "info" for s in summary):
            fail(f"open loop: serve.csv should hold the p99 TTFT rows (mode serve-open, info), got {summary}")
        for needle in ("open loop, Poisson arrivals at 40 req/s", "p99 TTFT", "unserved"):
            if needle not in proc.stdout:
                fail(f"open loop: stdout lacks {needle!r}:\n{proc.stdout[-3000:]}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pass
        else:
            drawn = subprocess.run([sys.executable, plot, out], capture_output=True, text=True, timeout=120)
            if drawn.returncode != 0 or not os.path.exists(os.path.join(out, "serve_open.png")):
                fail(f"plot.py did not draw serve_open.png: {drawn.stdout[-500:]} {drawn.stderr[-2000:]}")
            if os.path.exists(os.path.join(out, "serve.png")):
                fail("plot.py drew the closed-loop serve.png from open-loop runs only")
    for bad in ("0", "-1", "fast"):
        p = subprocess.run([bench, "serve", "--quick", "--serve_policies=none", f"--serve_rates={bad}",
                            f"--karakvd={karakvd}"], capture_output=True, text=True, timeout=60)
        if p.returncode == 0 or f"--serve_rates: '{bad}' is not a rate" not in p.stderr:
            fail(f"--serve_rates={bad}: exit {p.returncode}, stderr {p.stderr[-1000:]!r}")
    # A request that cannot fit even an empty pool is an error naming the sizes, not a run that
    # spins through its steps decoding nothing.
    small = subprocess.run([bench, "serve", "--serve_policies=none", "--serve_batches=8", "--serve_pool_bytes=1MiB",
                            "--serve_prompt=1000-1200", "--serve_output=10-20", "--serve_steps=50",
                            "--serve_seconds=20", f"--karakvd={karakvd}"], capture_output=True, text=True, timeout=60)
    if small.returncode == 0 or "does not fit the pool with nothing else running" not in small.stderr:
        fail(f"a request larger than the pool: exit {small.returncode}, stderr {small.stderr[-1000:]!r}")
    return len(runs)


def check_staging_flag(bench, karakvd):
    """--serve_staging: an unknown kind is refused naming the flag and the choices; device staging on
    the CPU backend is refused by the workers' Attach naming --backend=cuda (a GPU run is scripts/gpu-check.sh).
    --serve_worker_compute, --serve_dtype and --serve_stream_ordered (and P3's --p3_stream_ordered)
    refusals likewise."""
    with tempfile.TemporaryDirectory(prefix="karakv-serve-staging.") as out:
        base = [bench, "serve", "--quick", "--serve_policies=none", "--serve_batches=8", f"--karakvd={karakvd}",
                f"--out_dir={out}"]
        bad = subprocess.run(base + ["--serve_staging=gpu"], capture_output=True, text=True, timeout=60)
        if bad.returncode == 0 or "--serve_staging=gpu: expected shm, device" not in bad.stderr:
            fail(f"--serve_staging=gpu: exit {bad.returncode}, stderr {bad.stderr[-1000:]!r}")
        dev = subprocess.run(base + ["--serve_staging=device"], capture_output=True, text=True, timeout=120)
        if dev.returncode == 0 or "--backend=cuda" not in dev.stderr:
            fail(f"--serve_staging=device on the CPU backend: exit {dev.returncode}, stderr {dev.stderr[-1500:]!r}")
        # --serve_worker_compute: an unknown kind is refused naming the choices; gemm (the model's
        # products on the GPU) with shm staging is refused naming the staging it needs; so is a pool
        # dtype karakvd has no name for.
        for flags, message in [
            (["--serve_worker_compute=cpu"], "--serve_worker_compute=cpu: expected sleep"),
            (["--serve_worker_compute=gemm"], "it needs --serve_staging=device or device_fd"),
            (["--serve_stream_ordered"], "--serve_stream_ordered orders device staging by CUDA events"),
            (["--serve_dtype=int8"], "--serve_dtype=int8: expected fp16, bf16 or fp32"),
            (["--serve_worker_compute=gemm", "--serve_staging=device", "--serve_dtype=fp32"],
             "use --serve_dtype=fp16 or bf16"),
        ]:
            bad = subprocess.run(base + flags, capture_output=True, text=True, timeout=60)
            if bad.returncode == 0 or message not in bad.stderr:
                fail(f"{flags}: exit {bad.returncode}, stderr {bad.stderr[-1000:]!r}")
        # P3 likewise: stream order is for device staging.
        p3 = subprocess.run([bench, "p3", "--p3_stream_ordered", f"--karakvd={karakvd}"], capture_output=True,
                            text=True, timeout=60)
        if p3.returncode == 0 or "--p3_stream_ordered orders device staging" not in p3.stderr:
            fail(f"p3 --p3_stream_ordered with shm staging: exit {p3.returncode}, stderr {p3.stderr[-1000:]!r}")
        # --serve_kara_params: a malformed entry is refused naming the flag; a well-formed one reaches
        # every kara sequence the workers create (an out-of-range rho is refused by the daemon's
        # CreateSequence, naming the parameter), and leaves other policies alone.
        kara = [bench, "serve", "--quick", "--serve_batches=8", f"--karakvd={karakvd}", f"--out_dir={out}"]
        bad = subprocess.run(kara + ["--serve_policies=kara", "--serve_kara_params=budget"], capture_output=True,
                             text=True, timeout=60)
        if bad.returncode == 0 or "--serve_kara_params: expected name=value (a number), got 'budget'" not in bad.stderr:
            fail(f"--serve_kara_params=budget: exit {bad.returncode}, stderr {bad.stderr[-1000:]!r}")
        out_of_range = subprocess.run(kara + ["--serve_policies=kara", "--serve_kara_params=rho=7"],
                                      capture_output=True, text=True, timeout=120)
        if out_of_range.returncode == 0 or "parameter rho=7 out of range" not in out_of_range.stderr:
            fail(f"--serve_kara_params=rho=7: exit {out_of_range.returncode}, stderr {out_of_range.stderr[-1500:]!r}")
        other = subprocess.run(kara + ["--serve_policies=none", "--serve_kara_params=rho=7"], capture_output=True,
                               text=True, timeout=120)
        if other.returncode != 0:
            fail(f"--serve_kara_params with policy none: exit {other.returncode}, stderr {other.stderr[-1500:]!r}")


if __name__ == "__main__":
    main()

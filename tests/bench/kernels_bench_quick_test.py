#!/usr/bin/env python3
"""Smoke test of `kernels_bench` on the CPU backend, small: it runs to the end with --quant, prints
every row scripts/gpu-check.sh parses ("name value unit"), and its quantized decode is compared with
the fp16 decode over the same tokens (a mean relative error well under 1: a misplaced tail or
quantized table would give about 1 or more). An unknown --quant format is refused with exit 2,
naming the format and the ones expected. Times are not judged.

Usage: kernels_bench_quick_test.py KERNELS_BENCH
"""
import subprocess
import sys

FORMATS = ["kivi2", "kivi4", "tq2", "tq3", "tq4"]
# Bounds on the mean relative L2 error of attention outputs over uniform K/V (docs/BENCHMARKS.md,
# "Quantized storage": about 0.1 at 4 bits, 0.3 at 3, 0.6 at 2 on Gaussian data).
MAX_ERR = {"kivi2": 0.9, "kivi4": 0.3, "tq2": 0.9, "tq3": 0.6, "tq4": 0.4}


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def main():
    bench = sys.argv[1]
    cmd = [bench, "--backend=cpu", "--seqs=3", "--tokens=700", "--iters=1", "--threads=1",
           "--quant=" + ",".join(FORMATS)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(p.stdout)
    if p.returncode != 0:
        fail(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr}")
    rows = {}
    for line in p.stdout.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        parts = line.split()
        if len(parts) != 3:
            fail(f"row '{line}' is not 'name value unit'")
        rows[parts[0]] = float(parts[1])
    expected = ["decode_layer_us", "decode_step_ms", "decode_bandwidth", "kara_tick_ms", "kara_tick_vs_decode_step"]
    for f in FORMATS:
        expected += [f"quant_{f}_layer_us", f"quant_{f}_vs_fp16", f"quant_{f}_bandwidth", f"quant_{f}_rel_err"]
    for name in expected:
        if name not in rows:
            fail(f"row {name} missing")
        if not rows[name] > 0:
            fail(f"{name} = {rows[name]}, expected > 0")
    for f in FORMATS:
        if rows[f"quant_{f}_rel_err"] > MAX_ERR[f]:
            fail(f"quant_{f}_rel_err {rows[f'quant_{f}_rel_err']} > {MAX_ERR[f]}")
    for f in FORMATS:
        if f"# quant {f}:" not in p.stdout:
            fail(f"no description line for {f}")

    bad = subprocess.run([bench, "--quant=kivi4,kivi8"], capture_output=True, text=True, timeout=60)
    if bad.returncode != 2:
        fail(f"--quant=kivi4,kivi8 exited {bad.returncode}, expected 2")
    if "kivi8" not in bad.stderr or "kivi2, kivi4, tq2, tq3, tq4" not in bad.stderr:
        fail(f"--quant=kivi8 refusal does not name the format and the expected ones: {bad.stderr}")
    # The CUDA choices are checked before any device is looked for: refused here too.
    bad = subprocess.run([bench, "--backend=cuda", "--quant_decode=bogus"], capture_output=True, text=True, timeout=60)
    if bad.returncode != 2 or "--quant_decode: " not in bad.stderr or "expected auto, staged or fused" not in bad.stderr:
        fail(f"--quant_decode=bogus: exit {bad.returncode}, expected 2 naming the choices: {bad.stderr}")
    print("PASS")


if __name__ == "__main__":
    main()

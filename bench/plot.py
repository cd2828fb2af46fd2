#!/usr/bin/env python3
"""Draws the ratios of a karakv-bench run (the p1/p2/p3 CSVs of --out_dir) as one bar chart PNG.

Usage: bench/plot.py RESULTS_DIR [OUTPUT.png]   (default output: RESULTS_DIR/ratios.png)
Needs matplotlib; without it, says so and exits 0 so that scripts/bench.sh carries on.
"""
import csv
import os
import re
import sys


def read_rows(results_dir):
    rows = []
    for mode in ("p1", "p2", "p3"):
        path = os.path.join(results_dir, mode + ".csv")
        if os.path.exists(path):
            with open(path, newline="") as f:
                rows.extend(csv.DictReader(f))
    return rows


def target_value(text):
    """'>= 3x' -> 3.0, '>= 60%' -> 0.6, '-' -> None."""
    m = re.match(r"\s*[<>]=\s*([0-9.]+)\s*(x|%)", text)
    if not m:
        return None
    v = float(m.group(1))
    return v / 100 if m.group(2) == "%" else v


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    results_dir = sys.argv[1]
    output = sys.argv[2] if len(sys.argv) > 2 else os.path.join(results_dir, "ratios.png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed; skipping the chart", file=sys.stderr)
        return 0
    rows = read_rows(results_dir)
    if not rows:
        print(f"plot.py: no p1/p2/p3 CSV in {results_dir}", file=sys.stderr)
        return 1

    modes = [m for m in ("P1", "P2", "P3") if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4.5), squeeze=False)
    colors = {"PASS": "tab:green", "MISS": "tab:red", "info": "tab:gray"}
    for ax, mode in zip(axes[0], modes):
        mine = [r for r in rows if r["mode"] == mode]
        ratios = [float(r["ratio"]) for r in mine]
        ax.bar(range(len(mine)), ratios, color=[colors.get(r["result"], "tab:gray") for r in mine])
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([r["metric"] for r in mine], rotation=30, ha="right", fontsize=7)
        for r in mine:
            t = target_value(r["target"])
            if t is not None:
                ax.axhline(t, color="black", linestyle="--", linewidth=1)
                ax.text(len(mine) - 0.5, t, " target " + r["target"], va="bottom", ha="right", fontsize=8)
        ax.set_title(f"{mode}: karakv / {mine[0]['baseline_name']}", fontsize=9)
        ax.set_ylabel("ratio")
    fig.suptitle("karakv-bench ratios (green PASS, red MISS, grey context)")
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    print(f"plot.py: wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

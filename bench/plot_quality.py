#!/usr/bin/env python3
"""Draws llama_quality's CSV: one panel per task.

  perplexity tasks: perplexity vs resident K/V memory per sequence at the end of the run (MiB,
                    as the daemon's blocks hold it), one point per policy or format, labelled
  greedy tasks:     greedy agreement with the uncompressed run vs the same memory axis

Usage: bench/plot_quality.py QUALITY_CSV OUTPUT_PNG
Needs matplotlib; without it, says so and exits 0.
"""
import csv
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_quality.py: matplotlib is not installed; no plot drawn")
        return
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    tasks = []
    for r in rows:
        if (r["task"], r["kind"]) not in tasks:
            tasks.append((r["task"], r["kind"]))
    if not tasks:
        sys.exit(f"{sys.argv[1]}: no rows")
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 5), squeeze=False)
    for ax, (task, kind) in zip(axes[0], tasks):
        sel = [r for r in rows if r["task"] == task and r["kind"] == kind]
        ykey = "perplexity" if kind == "perplexity" else "greedy_agreement"
        for r in sel:
            x = float(r["kv_mib_final"])
            y = float(r[ykey]) * (100 if kind == "greedy" else 1)
            name = r["policy"]
            marker = "o"
            color = "black"
            if name.startswith("kara"):
                color, marker = "tab:blue", "*"
            elif name.startswith(("kivi", "tq")):
                color, marker = "tab:purple", "s"
            elif name != "none":
                color = "tab:orange"
            ax.scatter([x], [y], color=color, marker=marker, s=70 if marker == "*" else 40, zorder=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("resident K/V per sequence at the end (MiB)")
        ax.set_ylabel("perplexity (lower is better)" if kind == "perplexity" else "greedy agreement with none (%)")
        ax.set_title(f"{task}: {kind}")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()

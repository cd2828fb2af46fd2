#!/usr/bin/env python3
"""Quality against memory, one panel per perplexity task (the Pareto view of docs/QUALITY.md):
perplexity above `none` (%) against MEAN resident K/V tokens per sequence, one curve per policy
family joined in memory order. Rows come from llama_quality CSVs: a Kara point labelled `kara`
is Kara's version 2 defaults, any other Kara point (e.g. `k70`, `kb994`: a budget) is "kara v3",
with the prompt kept or windowed (`prompt=1` in its params); `snapkv@k70` and plain `snapkv` are both snapkv, and so on. `none`'s perplexity per task
is taken from a none row of any of the files.

Usage: bench/plot_pareto.py OUTPUT_PNG QUALITY_CSV [QUALITY_CSV ...]
Needs matplotlib; without it, says so and exits 0.
"""
import sys

from plotkit import pyplot, read_rows

BASELINES = ("snapkv", "streaming", "h2o", "chunkkv")


def family(row):
    base = row["policy"].split("@")[0]
    if base in BASELINES or base == "none":
        return base
    if base == "kara":
        return "kara (v2 defaults)"
    return "kara v3, prompt windowed" if "prompt=1" in row["params"].split() else "kara v3, prompt kept"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    plt = pyplot("plot_pareto.py")
    if plt is None:
        return
    rows = [r for r in read_rows(sys.argv[2:]) if r["kind"] == "perplexity" and r["perplexity"]]
    tasks = sorted({r["task"] for r in rows})
    none = {r["task"]: float(r["perplexity"]) for r in rows if r["policy"] == "none"}
    tasks = [t for t in tasks if t in none]
    if not tasks:
        sys.exit("no perplexity task with a none row")
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.6), squeeze=False)
    styles = {"kara (v2 defaults)": "D", "kara v3, prompt kept": "o-", "kara v3, prompt windowed": "P-", "snapkv": "s-", "streaming": "^-",
              "h2o": "v-", "chunkkv": "x-"}
    for ax, task in zip(axes[0], tasks):
        series = {}
        for r in rows:
            if r["task"] != task or r["policy"] == "none" or not r["resident_mean"]:
                continue
            gap = 100.0 * (float(r["perplexity"]) / none[task] - 1.0)
            series.setdefault(family(r), {})[round(float(r["resident_mean"]))] = gap
        for name in sorted(series):
            pts = sorted(series[name].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(name, "o-"), label=name, markersize=6)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_title(f"{task} (none: {none[task]:.3f})")
        ax.set_xlabel("mean resident tokens per sequence")
        ax.set_ylabel("perplexity above none (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)
    print("wrote", sys.argv[1])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Draws llama_quality's CSV: one panel per task.

  perplexity tasks: perplexity vs resident K/V memory per sequence at the end of the run (MiB,
                    as the daemon's blocks hold it), one point per policy or format, labelled;
                    a perplexity above 1.5x the uncompressed run's sits at the top edge
  greedy tasks:     greedy agreement with the uncompressed run vs the same memory axis

Usage: bench/plot_quality.py OUTPUT_PNG QUALITY_CSV [QUALITY_CSV ...]
Needs matplotlib; without it, says so and exits 0.
"""
import sys

from plotkit import pyplot, read_rows


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    plt = pyplot("plot_quality.py")
    if plt is None:
        return
    rows = read_rows(sys.argv[2:])
    tasks = []
    for r in rows:
        if (r["task"], r["kind"]) not in tasks:
            tasks.append((r["task"], r["kind"]))
    if not tasks:
        sys.exit(f"{' '.join(sys.argv[2:])}: no rows")
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 5), squeeze=False)
    for ax, (task, kind) in zip(axes[0], tasks):
        sel = [r for r in rows if r["task"] == task and r["kind"] == kind]
        ykey = "perplexity" if kind == "perplexity" else "greedy_agreement"
        # Perplexities beyond 1.5x the uncompressed run are drawn at the top edge, value in the label.
        base = [float(r[ykey]) for r in sel if r["policy"] == "none"]
        cap = 1.5 * base[0] if kind == "perplexity" and base else None
        if cap:
            low = min(float(r[ykey]) for r in sel)
            ax.set_ylim(bottom=low - 0.04 * (cap - low), top=cap)
        for r in sel:
            x = float(r["kv_mib_final"])
            y = float(r[ykey]) * (100 if kind == "greedy" else 1)
            name = r["policy"]
            if cap and y > cap:
                name, y = f"{name}: {y:.1f} (off scale)", cap * 0.99
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
    fig.savefig(sys.argv[1], dpi=110)
    print(f"wrote {sys.argv[1]}")


if __name__ == "__main__":
    main()

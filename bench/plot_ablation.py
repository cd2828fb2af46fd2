#!/usr/bin/env python3
"""Draws llama_quality --kara_points results: perplexity against MEAN resident K/V tokens per
sequence (COMPRESSION.md section 4 matches baselines on it), one series per policy: every Kara point
(labelled), and each baseline sized to the points (snapkv, streaming, h2o, joined in memory order).
Greedy tasks, when present, get a second panel with agreement on the same axis (mean resident
tokens of the sequences still decoding, sampled every 8th step; end memory for older CSVs without it).

Usage: bench/plot_ablation.py OUTPUT_PNG ABLATION_CSV [ABLATION_CSV ...]
Needs matplotlib; without it, says so and exits 0.
"""
import sys

from plotkit import pyplot, read_rows


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    plt = pyplot("plot_ablation.py")
    if plt is None:
        return
    rows = read_rows(sys.argv[2:])
    kinds = [k for k in ("perplexity", "greedy") if any(r["kind"] == k for r in rows)]
    if not kinds:
        sys.exit("no rows")
    fig, axes = plt.subplots(1, len(kinds), figsize=(7.5 * len(kinds), 5.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sel = [r for r in rows if r["kind"] == kind]
        ykey = "perplexity" if kind == "perplexity" else "greedy_agreement"
        has_mean = all(r["resident_mean"] for r in sel)
        xkey = "resident_mean" if has_mean else "resident_final"
        series = {}
        for r in sel:
            name = r["policy"]
            if not r[ykey] or not r[xkey]:
                continue
            base = name.split("@")[0]
            group = base if base in ("snapkv", "streaming", "h2o", "chunkkv", "none", "kara") else "kara points"
            series.setdefault(group, []).append((float(r[xkey]), float(r[ykey]), name))
        for group, pts in sorted(series.items()):
            pts.sort()
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            style = {"kara points": "o", "none": "*", "kara": "D"}.get(group, "s-")
            label = "kara (the defaults)" if group == "kara" else group
            ax.plot(xs, ys, style, label=label, markersize=8 if group in ("none", "kara") else 5,
                    alpha=0.85 if group != "kara points" else 0.6)
            # Ablation points crowd near the defaults' memory: only points away from the crowd are
            # named (the tables in docs/QUALITY.md name every point).
            if group == "kara points":
                for x, y, name in pts:
                    if sum(1 for px, py, _ in pts if abs(px - x) < 25) > 2:
                        continue
                    ax.annotate(name.replace("p_", "").replace("_rho0.25", ""), (x, y), fontsize=7,
                                xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel("mean resident tokens per sequence over the decode steps" if has_mean
                      else "resident tokens per sequence at the end")
        ax.set_ylabel(ykey.replace("_", " "))
        ax.set_title(f"{sel[0]['task']}: {kind} (SmolLM2-135M)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)
    print("wrote", sys.argv[1])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Quality against memory, one panel per task (the Pareto view of docs/QUALITY.md): for a
perplexity task, perplexity above `none` (%), for the long-generation fidelity task (`longgen`),
the mean KL divergence from `none` (nats), for GSM8K (`greedy`), the greedy agreement with
`none` (%), against MEAN resident K/V tokens per sequence, one
curve per policy family joined in memory order. Rows come from llama_quality CSVs: a Kara point
labelled `kara` without a `budget` in its params is Kara's version 2 defaults (the suite's rows of
2026-12-06, when the CSV recorded only the parameters given); since 2026-12-07 llama_quality records
every parameter as the daemon resolved it, so a `kara` row of the defaults carries its budget and is
named like any other point; any other Kara point is "kara v3" when it has a
`budget` (e.g. `k70`, `kb994`), "kara v3 fit" / "kara v3 fit 2" with `fit=1` / `fit=2` as well, "kara v3 share" with
`share` (the budget a share of the length), "kara, two levels" with `rho2`, "kara, growing recent" with
`grow`, and "kara v2" otherwise, with the prompt kept, windowed or auto
(`prompt=1` or `prompt=2` in its params); `snapkv@k70` and plain `snapkv` are both snapkv, and so on. `none`'s
perplexity per task is taken from a none row of any of the files.

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
    params = dict(p.split("=", 1) for p in row["params"].split() if "=" in p)
    if base == "kara" and "budget" not in params:
        return "kara (v2 defaults)"
    version = "kara v3" if float(params.get("budget", "0")) > 0 else "kara v2"
    if version == "kara v3" and params.get("fit") in ("1", "2"):
        version = "kara v3 fit" if params["fit"] == "1" else "kara v3 fit 2"
    if float(params.get("share", "0")) > 0:
        fit = params.get("fit", "1")
        version = "kara v3 share" if fit == "1" else f"kara v3 share, fit {fit}"
    if float(params.get("rho2", "0")) > 0:
        version = "kara, two levels"
    elif float(params.get("grow", "0")) > 0:
        version = "kara, growing recent"
    prompt = {"1": "prompt windowed", "2": "prompt auto"}.get(params.get("prompt", "0"), "prompt kept")
    return f"{version}, {prompt}"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    plt = pyplot("plot_pareto.py")
    if plt is None:
        return
    rows = [r for r in read_rows(sys.argv[2:]) if (r["perplexity"] and (
        r["kind"] == "perplexity" or (r["kind"] == "fidelity" and r.get("positions") == "all"))) or (
        r["kind"] == "greedy" and r.get("greedy_agreement"))]
    tasks = sorted({r["task"] for r in rows})
    none = {r["task"]: float(r["perplexity"] or 0) for r in rows if r["policy"] == "none"}
    tasks = [t for t in tasks if t in none]
    if not tasks:
        sys.exit("no perplexity or fidelity task with a none row")
    fidelity = {r["task"] for r in rows if r["kind"] == "fidelity"}
    greedy = {r["task"] for r in rows if r["kind"] == "greedy"}
    cols = min(3, len(tasks))
    nrows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.8 * cols, 4.8 * nrows), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    styles = {"kara (v2 defaults)": "D", "kara v2, prompt windowed": "X", "kara v3, prompt kept": "o-",
              "kara v3, prompt windowed": "P-", "kara v3 fit, prompt windowed": "d-", "kara v3 fit, prompt kept": "d--", "kara v3 fit, prompt auto": "D-", "kara v3 fit 2, prompt windowed": "1-",
              "kara, two levels, prompt windowed": "*-", "kara, growing recent, prompt windowed": "h", "snapkv": "s-", "streaming": "^-", "h2o": "v-", "chunkkv": "x-"}
    for ax, task in zip(axes.flat, tasks):
        series = {}
        for r in rows:
            if r["task"] != task or r["policy"] == "none" or not r["resident_mean"]:
                continue
            if task in fidelity:
                gap = float(r["kl_vs_none"])
            elif task in greedy:
                gap = 100.0 * float(r["greedy_agreement"])
            else:
                gap = 100.0 * (float(r["perplexity"]) / none[task] - 1.0)
            # The first row of a family at a memory level: later ones there are variants (R, agg).
            series.setdefault(family(r), {}).setdefault(round(float(r["resident_mean"])), gap)
        for name in sorted(series):
            pts = sorted(series[name].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(name, "o-"), label=name, markersize=6)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        if task in greedy:
            ax.set_title(f"{task}: greedy answers against none's")
            ax.set_ylabel("greedy agreement with none (%)")
        elif task in fidelity:
            ax.set_title(f"{task}: none's own samples, teacher-forced")
            ax.set_ylabel("mean KL(none || policy), nats")
        else:
            ax.set_title(f"{task} (none: {none[task]:.3f})")
            ax.set_ylabel("perplexity above none (%)")
        ax.set_xlabel("mean resident tokens per sequence")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)
    print("wrote", sys.argv[1])


if __name__ == "__main__":
    main()
